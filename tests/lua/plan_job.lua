-- A small sharded training job for tests/lua/test_plan.lua: GPT (vocab 256,
-- 2 layers, width 64), one unit per block, 2 steps of AdamW. Run for real
-- (under mpirun) it prints each allocator tag's peak and held bytes per
-- rank; under `fsdp-lua --plan --world=N --rank=r` the planner runs it on
-- the counting device instead and prints its plan.
--   mpirun -np 2 fsdp-lua tests/lua/plan_job.lua [--strategy=] [--compute=] [--recompute] [--compress=int8|topk]
--                                             [--diverge-rank=R]
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local dryrun = require "fsdp.dryrun"
local dist = fsdp.distributed

local o = ... or {}
local cfg = { vocab_size = 256, n_layer = 2, n_head = 4, n_embd = 64, block_size = 32 }
local device = fsdp.default_device()
fsdp.memory.empty_cache(device)
local base = fsdp.memory.all(device)
fsdp.memory.reset_peak(device)
-- (the collector at fixed points, as the planner runs it: dead handles go
-- back at the same moments in both runs)
local now
dryrun.deterministic(function()
  local rank = dist.rank()
  local model = nn.GPT(cfg)
  if o.recompute then nn.recompute(model, "Block") end
  local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), strategy = o.strategy or "full_shard",
    group_size = o.group_size, mixed_precision = { compute = o.compute or "f32" }, seed = 5,
    compress = o.compress and { grads = o.compress, density = 0.05, block = 64 } or nil })
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-3 })
  for step = 1, 2 do
    local x, y = t.token_batch(step * 31 + rank * 7 + 1, 2, 32, cfg.vocab_size)
    local _, loss = model(x, y)
    -- (--diverge-rank=R: that rank alone sums a number over the ranks, as a
    -- recipe that branches on its rank would; --plan --all-ranks names it)
    if o.diverge_rank == rank then dist.sum(1) end
    loss:backward()
    sharded:clip_grad_norm(1.0)
    opt:step()
    sharded:zero_grad()
  end
  now = fsdp.memory.all(device)
end)
for _, tag in ipairs(fsdp.memory.tags) do
  print(string.format("rank %d %s peak %d current %d", dist.rank(), tag, now[tag].peak - base[tag].current,
    now[tag].current - base[tag].current))
end
