-- Per-rank memory of a sharded GPT, measured by a real run and by the
-- planner (fsdp.plan: the same model, fsdp.shard and steps on the counting
-- device and a communicator that moves nothing, as this rank of this
-- world): every allocator tag's peak and what is held after the steps must
-- be equal, to the byte. The model's parameters, gradients and AdamW state
-- dominate (vocab 512, 4 layers, width 128), one unit per block, 2 steps.
-- The allocator's statistics are process-wide (one process per rank), so
-- this script builds nothing but the sharded model and its batches.
--   FSDP_COMM_SYNC=1 mpirun -np 4 fsdp-lua tests/distributed/test_fsdp_memory.lua   (also on 1 rank)
-- FSDP_COMM_SYNC=1 completes every collective before it returns, as the
-- planner's communicator does; without it a lagging comm thread may hold
-- a flat gradient (tag grad) or a reduction's buffer (comm) a little
-- longer, and only the other tags are compared exactly.
-- Options: --strategy= --group-size= --compute=bf16 --reduce= --limit= --prefetch= --forward-prefetch
-- --offload (on a GPU: shards and optimizer state in host memory, compared as well)
-- --head-chunk=R (the memory-first head: the tied embedding a sliced unit, read by chunks of R rows)
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local planner = require "fsdp.plan"
local dist = fsdp.distributed

local opts = ... or {}
local rank, world = dist.rank(), dist.world()
local device = fsdp.default_device()
local cfg = { vocab_size = 512, n_layer = 4, n_head = 4, n_embd = 128, block_size = 32, head_chunk = opts.head_chunk }
local B, T, STEPS = 2, 32, 2
local shard_opts = {
  policy = fsdp.policy.per_block(), strategy = opts.strategy or "full_shard", group_size = opts.group_size,
  mixed_precision = { compute = opts.compute or "f32", reduce = opts.reduce }, limit = opts.limit, seed = 3,
  forward_prefetch = opts.forward_prefetch, prefetch = opts.prefetch, offload = opts.offload == true,
}
local synced = os.getenv("FSDP_COMM_SYNC") == "1"

local function batch(step, r) return t.token_batch(step * 7919 + r * 104729 + 17, B, T, cfg.vocab_size) end

-- The training loop both runs share: on the real ranks, and on the planner's.
local function train(r, steps, losses, so)
  local model = nn.GPT(cfg)
  local sharded = fsdp.shard(model, so or shard_opts)
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-3, betas = { 0.9, 0.95 } })
  for step = 1, steps do
    local x, y = batch(step, r)
    local _, loss = model(x, y)
    loss:backward()
    sharded:clip_grad_norm(1.0)
    opt:step()
    sharded:zero_grad()
    if losses then losses[step] = loss:item() end
  end
  return sharded, model, opt
end

-- ---- the real run ----
fsdp.memory.empty_cache(device)
local base, base_host = fsdp.memory.all(device), fsdp.memory.all("cpu")
fsdp.memory.reset_peak(device)
fsdp.memory.reset_peak("cpu")
local losses = {}
-- (Lua's collector at fixed points, as the planner runs it, so that dead
-- tensor handles go back at the same moments in both runs)
local dryrun = require "fsdp.dryrun"
local sharded, model, opt = dryrun.deterministic(train, rank, STEPS, losses)
t.ok(losses[1] > 5 and losses[1] < 7.5, string.format("rank %d: first loss %.4f is about ln(512) = 6.24", rank,
  losses[1]))
local now, now_host = fsdp.memory.all(device), fsdp.memory.all("cpu")
local measured, measured_host = {}, {}
for _, tag in ipairs(fsdp.memory.tags) do
  measured[tag] = { peak = now[tag].peak - base[tag].current, current = now[tag].current - base[tag].current }
  measured_host[tag] = { peak = now_host[tag].peak - base_host[tag].current,
    current = now_host[tag].current - base_host[tag].current }
end

-- ---- the plan of this rank ----
local p = planner.run(function() train(rank, STEPS) end,
  { world = world, rank = rank, mimic = device == "cuda" and "cuda" or "cpu" })
local function mib(b) return b / 2 ^ 20 end
if rank == 0 then print(planner.format(p)) end

local lines = { string.format("rank %d of %d on %s: real run vs plan, peak bytes%s", rank, world, device,
  synced and "" or " (FSDP_COMM_SYNC unset: grad and comm not compared)") }
local offloaded = sharded.offload
for _, tag in ipairs(fsdp.memory.tags) do
  local real, planned = measured[tag], p.memory[tag]
  lines[#lines + 1] = string.format("  %-10s %12d %12d  (%.3f MiB)%s", tag, real.peak, planned.peak, mib(real.peak),
    real.peak == planned.peak and "" or "  <- differs")
  if synced or (tag ~= "grad" and tag ~= "comm") then
    t.eq(planned.peak, real.peak, string.format("rank %d of %d: %s peak, plan = real run", rank, world, tag))
    t.eq(planned.current, real.current, string.format("rank %d of %d: %s held after the steps, plan = real run",
      rank, world, tag))
  end
  if offloaded and (tag == "param" or tag == "grad" or tag == "optimizer") then
    t.eq(p.host[tag].peak, measured_host[tag].peak,
      string.format("rank %d of %d: host %s peak (offload), plan = real run", rank, world, tag))
  end
end
t.ok(measured.param.peak > 0 and measured.activation.peak > 0 and
  (offloaded and measured_host or measured).optimizer.peak > 0, "the run allocated")

-- traffic of the second step: what the real communicator counted
do
  local function step2_traffic()
    sharded:step_stats()   -- resets
    local x, y = batch(STEPS + 1, rank)
    local _, loss = model(x, y)
    loss:backward()
    sharded:clip_grad_norm(1.0)
    opt:step()
    sharded:zero_grad()
    return sharded:step_stats()
  end
  local s = step2_traffic()
  t.eq(p.traffic.gathered_bytes, s.gathered_bytes, string.format("rank %d: bytes all-gathered per step", rank))
  t.eq(p.traffic.reduced_bytes, s.reduced_bytes, string.format("rank %d: bytes reduced per step", rank))
end

-- sharding pays: on a shard group of G, the persistent shards and AdamW
-- state are about 1/G of a world of one's (the allocator rounds each
-- shard up by at most a quarter)
local one_opts = {}
for k, v in pairs(shard_opts) do one_opts[k] = v end
if one_opts.strategy == "hybrid_shard" then one_opts.strategy, one_opts.group_size = "full_shard", nil end
local one = planner.run(function() train(0, 1, nil, one_opts) end,
  { world = 1, mimic = device == "cuda" and "cuda" or "cpu" })
local G = sharded.shard_group and sharded.shard_group:size() or (shard_opts.strategy == "no_shard" and 1 or world)
if not offloaded then
  local ratio = p.persistent * G / one.persistent
  lines[#lines + 1] = string.format("  persistent param + grad + optimizer: %.3f MiB here, %.3f MiB on one rank "
    .. "(x %d / that = %.3f)", mib(p.persistent), mib(one.persistent), G, ratio)
  t.ok(ratio >= 0.95 and ratio <= 1.3, string.format("rank %d: persistent memory x %d / one rank's = %.3f", rank, G,
    ratio))
end

-- no_shard (f32) costs what DDP does: parameters, their gradients and the
-- two AdamW moments, 16 bytes per parameter, within 5% (no gathered copy
-- of the parameters, no flat gradient beside the gradient shard, no
-- reduction buffer); the planner agrees (the tags above)
if shard_opts.strategy == "no_shard" and (opts.compute or "f32") == "f32" and not offloaded then
  local psi = model:num_parameters()
  local pgo = measured.param.peak + measured.grad.peak + measured.optimizer.peak
  lines[#lines + 1] = string.format("  no_shard: param + grad + optimizer peak %.3f MiB, 16 x %d parameters = %.3f MiB "
    .. "(%.3f x)", mib(pgo), psi, mib(16 * psi), pgo / (16 * psi))
  t.ok(pgo <= 1.05 * 16 * psi, string.format("rank %d: no_shard param + grad + optimizer peak %d B is within 5%% of "
    .. "16 bytes x %d parameters (%.3f x)", rank, pgo, psi, pgo / (16 * psi)))
  t.eq(measured.comm.peak, 0, string.format("rank %d: no_shard all-reduces the gradient shards in place (no "
    .. "reduction buffer)", rank))
end

-- the caching allocator reuses its blocks: once the first steps have run,
-- later steps reserve next to nothing (a leak of per-step buffers grows
-- past a few units' worth in four steps)
local largest = 0
for _, u in ipairs(p.units) do largest = math.max(largest, u.padded * 4) end
local function more(n)
  for step = 1, n do
    local x, y = batch(10 + step, rank)
    local _, loss = model(x, y)
    loss:backward()
    sharded:clip_grad_norm(1.0)
    opt:step()
    sharded:zero_grad()
  end
end
more(1)
local reserved = fsdp.memory.stats().reserved
more(4)
local grown = fsdp.memory.stats().reserved - reserved
t.ok(grown >= 0 and grown <= 3 * largest, string.format("rank %d: reserved memory (%s) grew by %d B (of %d B) "
  .. "over four more steps: at most three of the largest unit's buffers (%d B)", rank, device, grown, reserved,
  3 * largest))
print(table.concat(lines, "\n"))
t.done()
