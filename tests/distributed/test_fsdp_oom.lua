-- A per-rank memory cap (fsdp.memory.set_cap) that the unsharded model
-- cannot live under but its 4-way sharded form can. The cap is 80% of what
-- the planner says the unsharded model needs for parameters, gradients and
-- AdamW state; parameters, gradients and activations fit under it, the
-- AdamW state does not.
--   fsdp-lua tests/distributed/test_fsdp_oom.lua                 one rank: the failure path. Building the model
--                                                         unsharded and taking an AdamW step must fail with
--                                                         the allocator's out-of-memory error naming the cap
--                                                         and the tag; the error is caught and counts as a pass.
--   mpirun -np 4 fsdp-lua tests/distributed/test_fsdp_oom.lua    4+ ranks: the success path. The sharded model
--                                                         trains 3 steps under the same cap.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local planner = require "fsdp.plan"

local rank, world = fsdp.rank(), fsdp.world()
local cfg = { vocab_size = 512, n_layer = 4, n_head = 4, n_embd = 256, block_size = 32 }
local T, STEPS = 32, 3
local shard_opts = { policy = fsdp.policy.per_block(), strategy = "full_shard", seed = 5 }
local function mib(b) return b / 2 ^ 20 end

-- the cap, from the planner: the same whatever the rank count (on one
-- rank, the shards are the whole model: what the unsharded one holds)
local p1 = planner.plan(nn.GPT(cfg), shard_opts, 1)
local p4 = planner.plan(nn.GPT(cfg), shard_opts, 4)
local unsharded = p1.persistent
local need4 = p4.peak + p4.memory.comm.peak      -- param + grad + optimizer + comm on each of 4 ranks
local cap = math.floor(0.9 * unsharded / 4096) * 4096
t.ok(cap < unsharded, string.format("cap %.2f MiB is below the unsharded %.2f MiB", mib(cap), mib(unsharded)))
t.ok(cap >= 1.3 * need4, string.format("cap %.2f MiB leaves room above the 4-rank need of %.2f MiB (+ activations)",
  mib(cap), mib(need4)))
-- parameters and gradients alone fit: the failure comes from the optimizer state
t.ok(p1.memory.param.current + p1.memory.grad.current < 0.7 * cap,
  "unsharded parameters and gradients fit under the cap")

-- one row per rank of a fixed batch: the same every step, so the loss falls
local function batch(rows)
  local ids, targets = {}, {}
  for b = 1, rows do
    ids[b], targets[b] = {}, {}
    for i = 1, T do
      local tok = ((rank * rows + b) * 131 + i * 17) % cfg.vocab_size
      ids[b][i] = tok
      targets[b][i] = (tok * 3 + 1) % cfg.vocab_size
    end
  end
  return fsdp.tensor(ids, { dtype = "i64" }), fsdp.tensor(targets, { dtype = "i64" })
end

if world == 1 then
  -- the failure path: the whole model, its gradients and AdamW state
  fsdp.memory.set_cap(cap)
  local reached = "nothing"
  local ok, err = pcall(function()
    local model = nn.GPT(cfg):materialize { seed = 5 }
    reached = "materialize"
    local opt = optim.AdamW(optim.decay_groups(model:named_parameters(), 0.1), { lr = 1e-3 })
    local x, y = batch(1)
    local _, loss = model(x, y)
    loss:backward()
    reached = "backward"
    opt:step()
    reached = "AdamW step"
  end)
  err = tostring(err)
  t.ok(not ok, "the unsharded model with AdamW must not fit under the cap")
  print(string.format("expected failure under a cap of %.2f MiB (unsharded model needs %.2f MiB), after %s:\n  %s",
    mib(cap), mib(unsharded), reached, err))
  t.ok(err:find("out of memory", 1, true), "the error says out of memory")
  t.ok(err:find("cap", 1, true), "the error mentions the cap")
  t.ok(err:find(string.format("cap of %.2f MiB", mib(cap)), 1, true), "the error gives the cap's size")
  t.eq(err:match("%(tag (%a+)%)"), "optimizer", "the error names the tag of the refused allocation")
  t.eq(reached, "backward", "parameters, gradients and activations fit; the AdamW state did not")
  -- the engine survives the error: drop everything, lift the cap, allocate again
  fsdp.memory.set_cap(0)
  collectgarbage()
  collectgarbage()
  local ok2 = pcall(function() return fsdp.zeros({ 1024, 1024 }):sum():item() end)
  t.ok(ok2, "the process keeps working after the out-of-memory error")
elseif world >= 4 then
  -- the success path: the same cap on every rank, the model sharded
  fsdp.memory.set_cap(cap)
  fsdp.memory.reset_peak()
  local model = nn.GPT(cfg)
  local sharded = fsdp.shard(model, shard_opts)
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-3 })
  local x, y = batch(1)
  local losses = {}
  for step = 1, STEPS do
    local _, loss = model(x, y)
    loss:backward()
    sharded:clip_grad_norm(1.0)
    opt:step()
    sharded:zero_grad()
    losses[step] = loss:item()
  end
  t.ok(losses[STEPS] < losses[1], string.format("rank %d: loss falls under the cap: %.4f -> %.4f", rank, losses[1],
    losses[STEPS]))
  local s = fsdp.memory.stats()
  t.ok(s.peak <= cap, string.format("rank %d: peak in use %d B within the cap %d B", rank, s.peak, cap))
  local pg = 0
  for _, tag in ipairs({ "param", "grad", "optimizer" }) do pg = pg + fsdp.memory.stats(tag).peak end
  local mine = planner.plan(nn.GPT(cfg), shard_opts, world, { rank = rank })
  -- the plan's collectives complete at once; a real comm thread that lags
  -- holds flat gradients longer (FSDP_COMM_SYNC=1: it completes them too)
  if os.getenv("FSDP_COMM_SYNC") == "1" then
    t.eq(pg, mine.peak, string.format("rank %d: param+grad+optimizer peak as planned", rank))
  else
    t.ok(pg >= mine.peak and pg <= 1.25 * mine.peak, string.format(
      "rank %d: param+grad+optimizer peak %d B between the planned %d B and a quarter more", rank, pg, mine.peak))
  end
  print(string.format("rank %d of %d: trained %d steps under a cap of %.2f MiB (unsharded needs %.2f MiB): "
    .. "peak %.2f MiB in use, of which param+grad+optimizer %.2f MiB (planned %.2f)", rank, world, STEPS, mib(cap),
    mib(unsharded), mib(s.peak), mib(pg), mib(mine.peak)))
else
  t.ok(false, string.format("run with 1 rank (the failure path) or 4 or more (the success path), not %d", world))
end
t.done()
