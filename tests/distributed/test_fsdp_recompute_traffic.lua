-- Activation recomputation costs no extra gathers: the recomputation in
-- backward reuses the gather that the unit's backward needs anyway. Bytes
-- all-gathered per step (the communicator's counters) with and without
-- nn.recompute on every block are equal, and equal the layout's count:
-- full_shard gathers each block twice (forward, backward) and the root
-- once; shard_grad_op gathers every unit once. Losses and final parameters
-- are the same with and without recomputation.
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_recompute_traffic.lua --strategy=shard_grad_op
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"

local opts = ... or {}
local strategy = opts.strategy or "full_shard"
local rank, world = fsdp.rank(), fsdp.world()
local cfg = { vocab_size = 96, n_layer = 3, n_head = 2, n_embd = 16, block_size = 8 }
local B, T, STEPS = 2, 8, 3

local function run(recompute)
  local model = nn.GPT(cfg)
  if recompute then nn.recompute(model, "Block") end
  local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), strategy = strategy, seed = 11 })
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-2 })
  local r = { losses = {} }
  for step = 1, STEPS do
    local x, y = t.token_batch(step * 13 + rank, B, T, cfg.vocab_size)
    sharded:step_stats()
    local _, loss = model(x, y)
    loss:backward()
    r.gathered = sharded:step_stats().gathered_bytes
    opt:step()
    sharded:zero_grad()
    r.losses[step] = loss:item()
  end
  r.root_padded, r.block_padded = 0, 0
  for _, u in ipairs(sharded.units) do
    if u.name == "root" then r.root_padded = u.padded else r.block_padded = r.block_padded + u.padded end
  end
  r.params = sharded:full_state_dict()
  return r
end

local plain, recomputed = run(false), run(true)
local per_block = strategy == "full_shard" and 2 or 1
local want = world > 1 and 4 * (plain.root_padded + per_block * plain.block_padded) or 0
t.eq(plain.gathered, want, string.format("%s without recomputation: %d gather(s) per block", strategy, per_block))
t.eq(recomputed.gathered, plain.gathered, string.format("%s with recomputation: the same bytes gathered (%d)",
  strategy, plain.gathered))
for step = 1, STEPS do
  t.near(recomputed.losses[step], plain.losses[step], 1e-6 * math.abs(plain.losses[step]),
    string.format("step %d: the same loss with recomputation", step))
end
local worst = 0
for path, v in pairs(plain.params) do
  local a, b = recomputed.params[path]:view(-1):tolist(), v:view(-1):tolist()
  for i = 1, #b do worst = math.max(worst, math.abs(a[i] - b[i])) end
end
t.ok(worst <= 1e-6, string.format("final parameters with recomputation within %.2g of those without", worst))
t.done()
