-- fsdp.plan: what a sharded training job holds and sends per rank, measured
-- by running it: the real model, the real fsdp.shard and one or two real
-- training steps on a communicator that moves nothing (world N, this
-- process playing rank r) and on the counting device, whose allocator is
-- the engine's own and only counts (fsdp.dryrun; DESIGN.md, decision 11).
-- Nothing here replays the engine: the figures are the allocator's and the
-- communicator's, so they are the real run's.
--
--   fsdp-lua --plan --world=8 recipes/gpt2.lua --preset=small    -- a recipe, as on 8 ranks (rank 0)
--   fsdp-lua --plan --world=8 --rank=3 recipes/gpt2.lua          -- as rank 3 sees it
--   local p = plan.plan(nn.GPT(cfg), { policy = fsdp.policy.per_block() }, 8)   -- a model and options
--   print(plan.format(p))
--
-- A plan holds, for its rank: memory per allocator tag (peak over the
-- steps, and what is held after them: the persistent part), the units of
-- every fsdp.shard call, the traffic of the last step (bytes all-gathered
-- and reduced, as fsdp_comm_stats counts them) and the kernel counts of
-- the last step (fsdp.meta). Collectives complete as soon as they are
-- issued, so the peaks are those of a run whose communication keeps up
-- (FSDP_COMM_SYNC=1 makes a real run do the same); a lagging comm thread
-- holds a flat gradient a little longer.
local fsdp = require "fsdp"
local core = require "fsdp.core"
local dryrun = require "fsdp.dryrun"

local M = {}

local function fail(msg, level) error("fsdp.plan: " .. msg, level or 3) end

local function check_world(world, rank)
  if type(world) ~= "number" or world < 1 or world ~= math.floor(world) then
    fail("world size must be a positive integer, got " .. tostring(world))
  end
  rank = rank or 0
  if type(rank) ~= "number" or rank < 0 or rank >= world or rank ~= math.floor(rank) then
    fail(string.format("rank must be a whole number in 0..%d, got %s", world - 1, tostring(rank)))
  end
  return rank
end

-- A plan from a dry run's result.
local function from_result(r, world, rank)
  local p = { world = world, rank = rank, mimic = r.mimic, steps_run = r.steps_run, whole_run = r.whole_run,
    memory = r.memory,
    host = r.host, units = {}, numel = 0, shards = r.sharded or {} }
  for _, s in ipairs(p.shards) do
    p.strategy, p.compute, p.reduce = s.strategy, s.compute, s.reduce
    p.group_size = s.shard_group and s.shard_group:size() or (s.strategy == "no_shard" and 1 or world)
    for _, u in ipairs(s.units) do
      p.units[#p.units + 1] = { name = u.name, numel = u.numel, tensors = #u.params, padded = u.padded,
        shard_numel = u.shard_numel }
      p.numel = p.numel + u.numel
    end
  end
  local last = r.steps[r.steps_run] or { traffic = { gathered_bytes = 0, reduced_bytes = 0 }, kernels = {} }
  p.traffic = last.traffic
  p.kernels = { calls = 0, bytes_read = 0, bytes_written = 0, flops = 0, launches = 0, syncs = 0 }
  for _, e in ipairs(last.kernels) do
    for k in pairs(p.kernels) do p.kernels[k] = p.kernels[k] + e[k] end
  end
  p.kernel_list = last.kernels
  p.timeline = last.timeline
  p.l2 = {}   -- per entry, the share of its bytes read an L2 rule serves (the GPU roofline's)
  for _, e in ipairs(last.kernels) do
    if (e.bytes_l2 or 0) > 0 and e.bytes_read > 0 then p.l2[e.name] = e.bytes_l2 / e.bytes_read end
  end
  p.backward = last.backward or { flops = 0, launches = 0, bytes = 0 }
  local m = p.memory
  p.peak = m.param.peak + m.grad.peak + m.optimizer.peak
  p.persistent = m.param.current + m.grad.current + m.optimizer.current
  return p
end

--- Runs fn(...) (a recipe's chunk, or any training loop that builds its
-- model, calls fsdp.shard and steps an fsdp.optim optimizer) as rank `rank`
-- of `world` on the counting device, for opts.steps (2) training steps.
-- opts.mimic: "cpu" or "cuda", the kernel set the op layer sees (default:
-- the default device's). opts.progress: a function(done, total) told the
-- steps done (fsdp.dryrun); by default a bar on a terminal (fsdp.progress),
-- drawn by rank 0 of the real job; false: none. opts.all_ranks: also run
-- every other rank (up to M.ALL_RANKS_UP_TO ranks) and report, per tag,
-- the largest peak of any rank (and the largest sums), as a real run's
-- --metrics does; the rest of the plan stays that of `rank`.
function M.run(fn, opts, ...)
  opts = opts or {}
  local world = opts.world or 1
  local rank = check_world(world, opts.rank)
  -- the kernel set of the device the job would compute on
  local mimic = opts.mimic or (fsdp.default_device() == "cuda" and "cuda" or "cpu")
  local progress = opts.progress
  if progress == nil and fsdp.distributed.rank() == 0 then
    progress = require("fsdp.progress").bar("plan", { unit = "steps" })
  end
  local steps = opts.steps or 2
  local others = {}   -- per tag, the largest of the other ranks: { peak, rank }
  if opts.all_ranks and world > 1 and world <= M.ALL_RANKS_UP_TO then
    -- Ranks hold equal shards, but each AdamW state tensor is one
    -- allocation per parameter slice, and where a rank's shard splits into
    -- other slices their rounding differs (GPT-2 small at N = 2: rank 1
    -- holds 1.30 MiB more optimizer state than rank 0). A real run's
    -- --metrics reports the largest rank per tag; so does this. The other
    -- ranks run first, each from the same collector counts and keeping
    -- nothing alive, so every run sees what a process of its own would.
    local counts = core.collect_counts()
    for other = 0, world - 1 do
      if other ~= rank then
        core.set_collect_counts(counts)
        local q = from_result(dryrun.run(fn, { steps = steps, world = world, rank = other, mimic = mimic }, ...),
          world, other)
        for tag, m in pairs(q.memory) do
          local w = others[tag] or { peak = -1, current = 0, reserved = 0 }
          if m.peak > w.peak then w.peak, w.rank = m.peak, other end
          w.current, w.reserved = math.max(w.current, m.current), math.max(w.reserved, m.reserved)
          others[tag] = w
        end
        others.sums = { peak = math.max(q.peak, others.sums and others.sums.peak or 0),
          persistent = math.max(q.persistent, others.sums and others.sums.persistent or 0) }
        -- its model goes back before the next run starts: a dead local and
        -- the JIT's compiled traces (which hold objects as constants) would
        -- keep it, and the memory held would move the collector's points
        q = nil
        jit.flush()
      end
    end
    core.set_collect_counts(counts)
  end
  local r = dryrun.run(fn, { steps = steps, world = world, rank = rank, mimic = mimic, progress = progress or nil }, ...)
  local p = from_result(r, world, rank)
  if others.sums then
    local most = {}
    for tag, m in pairs(p.memory) do
      local o = others[tag]
      most[tag] = { peak = m.peak, current = math.max(m.current, o.current), reserved = math.max(m.reserved, o.reserved),
        rank = rank }
      if o.peak > m.peak then most[tag].peak, most[tag].rank = o.peak, o.rank end
    end
    p.memory, p.all_ranks = most, true
    p.peak, p.persistent = math.max(p.peak, others.sums.peak), math.max(p.persistent, others.sums.persistent)
  end
  return p
end

--- Ranks the planner runs one by one for opts.all_ranks (each is one dry
-- run); beyond this, only the rank asked for.
M.ALL_RANKS_UP_TO = 256

--- The plan of sharding `model` (not materialized) with fsdp.shard options
-- `shard_opts` on `world` ranks, as `opts.rank` (0) sees it: AdamW and
-- opts.steps (2) steps of next-token loss on opts.batch (the world size)
-- sequences of opts.ctx tokens (the model's context) in all.
function M.plan(model, shard_opts, world, opts)
  opts = opts or {}
  if type(model) ~= "table" or not model._param_names then fail("expected an nn module, got " .. type(model)) end
  local rank = check_world(world, opts.rank)
  local cfg = model.cfg or {}
  local ctx = opts.ctx or cfg.block_size or 16
  local batch = opts.batch or world
  if batch % world ~= 0 then fail(string.format("batch %d is not divisible by %d ranks", batch, world)) end
  local vocab = cfg.vocab_size or 2
  local loop = function()
    local optim = require "fsdp.optim"
    local sharded = fsdp.shard(model, shard_opts or {})
    local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-3 })
    local n = batch / world * ctx
    local ids = fsdp.zeros({ batch / world, ctx }, { dtype = "i64" })
    for _ = 1, opts.steps or 2 do
      local _, loss = model(ids, ids)
      loss:backward()
      sharded:clip_grad_norm(1.0)
      opt:step()
      sharded:zero_grad()
    end
    return n, vocab
  end
  return M.run(loop, { world = world, rank = rank, steps = opts.steps, mimic = opts.mimic, progress = opts.progress })
end

-- ---- the report ----

local function mib(b) return string.format("%.2f", b / 2 ^ 20) end

local function commas(n)
  local s = tostring(math.floor(n))
  local k
  repeat s, k = s:gsub("^(-?%d+)(%d%d%d)", "%1,%2") until k == 0
  return s
end

local tag_about = {
  param = "master shards + gathered full buffers",
  grad = "gradient shards + flat gradients",
  optimizer = "optimizer state of this rank's slices",
  activation = "activations and their gradients",
  comm = "collective buffers",
  other = "everything else",
}

--- The plan as text: memory per tag (MiB and exact bytes), units, traffic
-- and kernel counts of a step.
function M.format(p)
  local L = {}
  local function add(...) L[#L + 1] = string.format(...) end
  local ran = p.whole_run and "the whole recipe, which made no optimizer step,"
    or string.format("%d real training step%s", p.steps_run, p.steps_run == 1 and "" or "s")
  add("FSDP plan: %d rank%s, %s, as rank %d (%s on the counting device, the %s kernel set)",
    p.world, p.world == 1 and "" or "s", p.strategy or "not sharded", p.rank, ran, p.mimic)
  if #p.units > 0 then
    add("model: %s parameters in %d unit%s, shard group of %d, compute %s, reduce %s", commas(p.numel), #p.units,
      #p.units == 1 and "" or "s", p.group_size, p.compute, p.reduce)
    local names = {}
    for i, u in ipairs(p.units) do names[i] = u.name end
    add("  units: %s", table.concat(names, " "))
  end
  add("")
  if p.all_ranks then
    add("memory per rank, the largest of the %d ranks (as --metrics reports), MiB", p.world)
    add("                                   peak   after the steps   peak bytes")
  else
    add("memory of rank %d, MiB              peak   after the steps   peak bytes", p.rank)
  end
  for _, tag in ipairs(fsdp.memory.tags) do
    local m = p.memory[tag]
    local on = m.rank and m.rank ~= p.rank and string.format(" (on rank %d)", m.rank) or ""
    add("  %-11s %12s %16s %13d   %s%s", tag, mib(m.peak), mib(m.current), m.peak, tag_about[tag], on)
  end
  add("  %-11s %12s %16s %13d   (peak of the sum)", "total", mib(p.memory.total.peak), mib(p.memory.total.current),
    p.memory.total.peak)
  add("  %-11s %12s %16s %13d", "param + grad + optimizer", mib(p.peak), mib(p.persistent), p.peak)
  add("  gathered buffers at their peak: param %s MiB, flat gradients %s MiB (above the shards)",
    mib(p.memory.param.peak - p.memory.param.current), mib(p.memory.grad.peak - p.memory.grad.current))
  if p.host and (p.host.param.peak > 0 or p.host.optimizer.peak > 0) then
    add("  host (offload): param %s, grad %s, optimizer %s MiB at their peaks", mib(p.host.param.peak),
      mib(p.host.grad.peak), mib(p.host.optimizer.peak))
  end
  add("")
  local tr = p.traffic
  local per = p.whole_run and "over the whole run" or string.format("per training step (step %d)", p.steps_run)
  add("traffic of rank %d %s: %s MiB all-gathered, %s MiB reduced", p.rank, per, mib(tr.gathered_bytes),
    mib(tr.reduced_bytes))
  for _, k in ipairs({ "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_reduce_doubles" }) do
    if tr[k] and tr[k].calls > 0 then
      add("  %-20s %6d call%s %12s MiB", (k:gsub("_", "-")), tr[k].calls, tr[k].calls == 1 and " " or "s",
        mib(tr[k].bytes))
    end
  end
  local k = p.kernels
  add("kernels %s: %d launches, %.2f GFLOP, %.3f GB read + %.3f GB written, %d host syncs",
    p.whole_run and "over the whole run" or "per step", k.launches, k.flops / 1e9, k.bytes_read / 1e9,
    k.bytes_written / 1e9, k.syncs)
  if p.backward.flops > 0 then
    local rest = k.flops - p.backward.flops
    add("  backward %.2f GFLOP, the rest (forward, optimizer) %.2f GFLOP: %.2f x (about 2 without activation "
      .. "recomputation, 3 with it)", p.backward.flops / 1e9, rest / 1e9, rest > 0 and p.backward.flops / rest or 0)
  end
  return table.concat(L, "\n")
end

return M
