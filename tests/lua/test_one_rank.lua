-- A world of one is the same code (DESIGN.md, decision 10): fsdp.shard on
-- one rank trains exactly as the unsharded model does, with its parameters
-- views of the master (nothing gathered or copied), at no more memory than
-- the unsharded model (param + grad + optimizer, and in total: at most 1%
-- above; the flat master and gradient shards are single allocations, so
-- the allocator's size classes round them differently, per tag).
--   fsdp-lua tests/lua/test_one_rank.lua [--layers=N --width=N --vocab=N --steps=N]
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"

local opts = ... or {}
local cfg = { vocab_size = opts.vocab or 1000, n_layer = opts.layers or 3, n_head = 4, n_embd = opts.width or 128,
  block_size = 32 }
local STEPS, B, T = opts.steps or 3, 2, 32
local tags = { "param", "grad", "optimizer", "activation", "comm" }

-- Trains STEPS steps; returns the losses and the peak bytes per tag above
-- what was in use before.
local function run(sharded)
  fsdp.collect()
  local base = {}
  for _, tag in ipairs(tags) do base[tag] = fsdp.memory.stats(tag).current end
  local base_total = fsdp.memory.stats().current
  fsdp.memory.reset_peak()
  local model = nn.GPT(cfg)
  local sh, opt
  if sharded then
    sh = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 5 })
    opt = optim.AdamW(sh:param_groups(0.1), { lr = 1e-3 })
  else
    model:materialize { seed = 5 }
    opt = optim.AdamW(optim.decay_groups(model:named_parameters(), 0.1), { lr = 1e-3 })
  end
  local losses = {}
  for step = 1, STEPS do
    local x, y = t.token_batch(step * 31 + 7, B, T, cfg.vocab_size)
    local _, loss = model(x, y)
    loss:backward()
    if sh then sh:clip_grad_norm(1.0) else optim.clip_grad_norm(model:parameters(), 1.0) end
    opt:step()
    opt:zero_grad()
    losses[step] = loss:item()
  end
  local peak = { total = fsdp.memory.stats().peak - base_total }
  for _, tag in ipairs(tags) do peak[tag] = fsdp.memory.stats(tag).peak - base[tag] end
  local gathered = sh and sh:step_stats().gathered_bytes or 0
  return losses, peak, gathered, sh
end

local l_plain, m_plain = run(false)
local l_shard, m_shard, gathered, sh = run(true)
t.eq(sh.direct, true, "one rank, f32: the direct schedule")
t.eq(gathered, 0, "nothing gathered on one rank")
for step = 1, STEPS do
  t.eq(l_shard[step], l_plain[step], "step " .. step .. ": the same loss, bit for bit")
end
-- the module fields are views of the master shard: a write to one shows in the other
local u = sh.units[1]
fsdp.no_grad(function() u.master:narrow(1, u.offsets[#u.offsets] + 1, 1):fill(0.25) end)
t.eq(sh.model.ln_f.bias:tolist()[1], 0.25, "a parameter is a view of its unit's master (ln_f.bias, first element)")

local function mib(b) return string.format("%.3f MiB", b / 2 ^ 20) end
print(string.format("GPT %d layers, width %d, vocab %d, %d steps: peak unsharded vs fsdp.shard on one rank",
  cfg.n_layer, cfg.n_embd, cfg.vocab_size, STEPS))
local pgo_plain, pgo_shard = 0, 0
for _, tag in ipairs({ "param", "grad", "optimizer" }) do
  pgo_plain, pgo_shard = pgo_plain + m_plain[tag], pgo_shard + m_shard[tag]
end
for _, tag in ipairs({ "param", "grad", "optimizer", "activation", "comm", "total" }) do
  print(string.format("  %-10s %12s %12s  %+.2f%%", tag, mib(m_plain[tag]), mib(m_shard[tag]),
    m_plain[tag] > 0 and 100 * (m_shard[tag] - m_plain[tag]) / m_plain[tag] or 0))
end
print(string.format("  %-10s %12s %12s  %+.2f%%", "p+g+o", mib(pgo_plain), mib(pgo_shard),
  100 * (pgo_shard - pgo_plain) / pgo_plain))
t.ok(pgo_shard <= 1.01 * pgo_plain,
  string.format("param + grad + optimizer peak %d B at most 1%% above the unsharded %d B", pgo_shard, pgo_plain))
t.ok(m_shard.total <= 1.01 * m_plain.total,
  string.format("total peak %d B at most 1%% above the unsharded %d B", m_shard.total, m_plain.total))
t.eq(m_shard.optimizer, m_plain.optimizer, "the same optimizer state")
t.eq(m_shard.comm, 0, "no communication buffers")

t.done()
