-- fsdp.dryrun: a recipe run for real on the counting device (DESIGN.md,
-- decision 11). The model, fsdp.shard's schedule, the optimizer and the op
-- layer all run as they would; the "meta" device computes nothing and its
-- allocator only counts, so what comes back are the memory figures per tag
-- (exactly those of a real run: the same caching allocator sees the same
-- requests), the kernel costs per table entry (fsdp.meta) and the traffic
-- of each training step. A step ends with an optimizer step; the run stops
-- after `steps` of them.
--
--   local dryrun = require "fsdp.dryrun"
--   local r = dryrun.run(function() ... a training loop ... end, { steps = 2, mimic = "cuda" })
--   r.memory.activation.peak, r.steps[2].kernels, r.steps[2].traffic.gathered_bytes
--
-- opts: steps (2), mimic ("cpu" or "cuda": whose kernel set the meta
-- device offers), world and rank (the communicator the recipe sees:
-- fsdp.distributed answers them; the default is a world of one), progress
-- (a function(done, total) told the steps done, in halves: forward, then
-- backward and optimizer step; done nil when the run stops early, e.g. a
-- fsdp.progress bar), synthetic_data (true: data.open reads nothing and
-- gives synthetic token ids, fsdp.data.synthetic). fsdp.distributed.print0
-- prints nothing meanwhile.
local ffi = require "ffi"
local fsdp = require "fsdp"
local core = require "fsdp.core"
local meta = require "fsdp.meta"
local optim = require "fsdp.optim"

local C, raise = core.C, core.raise

local M = {}

-- Raised after the last counted step to end the recipe; run() catches it.
M.STOP = setmetatable({}, { __tostring = function() return "fsdp.dryrun: the counted steps are done" end })

local i64 = ffi.new("int64_t[2]")
local kinds = { all_gather = C.FSDP_COLL_ALL_GATHER, reduce_scatter = C.FSDP_COLL_REDUCE_SCATTER,
  all_reduce = C.FSDP_COLL_ALL_REDUCE, broadcast = C.FSDP_COLL_BROADCAST, barrier = C.FSDP_COLL_BARRIER,
  all_reduce_doubles = C.FSDP_COLL_ALL_REDUCE_DOUBLES }

-- Collectives on the counting world (and everything split from it): calls
-- and bytes per kind.
local function traffic_now(comm)
  local t = {}
  for name, kind in pairs(kinds) do
    if C.fsdp_comm_counts(comm, kind, i64, i64 + 1) ~= 0 then raise() end
    t[name] = { calls = tonumber(i64[0]), bytes = tonumber(i64[1]) }
  end
  return t
end

-- a step's traffic: per kind, and as fsdp_comm_stats counts it (gathered:
-- all-gather outputs; reduced: reduce-scatter inputs and all-reduced tensors)
local function traffic_between(t0, t1)
  local d = {}
  for name in pairs(kinds) do
    d[name] = { calls = t1[name].calls - t0[name].calls, bytes = t1[name].bytes - t0[name].bytes }
  end
  d.gathered_bytes = d.all_gather.bytes
  d.reduced_bytes = d.reduce_scatter.bytes + d.all_reduce.bytes
  return d
end

local function memory_now(device)
  local t = {}
  for _, tag in ipairs(fsdp.memory.tags) do t[tag] = fsdp.memory.stats(tag, device) end
  t.total = fsdp.memory.stats(nil, device)
  return t
end

-- figures since the start: peaks over the run, what is held at the end
local function memory_since(base, now)
  local t = {}
  for tag, s in pairs(now) do
    t[tag] = { peak = s.peak - base[tag].current, current = s.current - base[tag].current,
      reserved = s.reserved - base[tag].reserved }
  end
  return t
end

local function check_opts(opts)
  local steps = opts.steps or 2
  if type(steps) ~= "number" or steps < 1 or steps ~= math.floor(steps) then
    error("fsdp.dryrun: steps must be a positive whole number, got " .. tostring(opts.steps), 3)
  end
  local mimic = opts.mimic or "cpu"
  if mimic ~= "cpu" and mimic ~= "cuda" then
    error("fsdp.dryrun: mimic must be \"cpu\" or \"cuda\", got " .. tostring(mimic), 3)
  end
  return steps, mimic
end

--- Runs fn(...) with Lua's collector at fixed points only: stopped, and
-- run by fsdp.core every 4096 tensor handles or when the default device's
-- bytes in use grow by half (as it always does), from a collection at the
-- start. Tensors whose handles are dead go back at those points, so two
-- runs of the same program free them at the same moments: the dry run and
-- a real run it is compared with (an incremental collection in between
-- would free some earlier).
function M.deterministic(fn, ...)
  local running = collectgarbage("isrunning")
  collectgarbage("stop")
  core.collect()
  local res = { pcall(fn, ...) }
  if running then collectgarbage("restart") end
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2)
end

-- The world the recipe sees: `world` ranks, this process playing `rank`,
-- over a communicator that moves nothing. Returns a function restoring it.
local function enter_world(world, rank)
  local dist = require "fsdp.distributed"
  if not dist._set_world then
    error("fsdp.dryrun: this fsdp.distributed cannot stand in a counting world", 0)
  end
  local g = dist.counting_group(world, rank)
  local prev = dist._set_world(g)
  return g, function()
    dist._set_world(prev)
    g:free()
  end
end

--- Runs fn(...) on the meta device until `steps` optimizer steps are done
-- (or fn returns). Returns { steps = { [k] = { kernels, traffic, memory } },
-- memory = { [tag] = { peak, current, reserved } }, host = the same for the
-- CPU allocator, sharded = every fsdp.shard result, steps_run, mimic };
-- each step also holds its timeline (fsdp.plan_time.read_timeline).
function M.run(fn, opts, ...)
  opts = opts or {}
  local steps, mimic = check_opts(opts)
  local prev_device = fsdp.default_device()
  meta.mimic(mimic)
  -- what an earlier run left for the collector goes back first, so that it
  -- is not counted against this one
  core.full_collect()
  core.full_collect()
  local world_group, leave_world = enter_world(opts.world or 1, opts.rank or 0)
  -- no data is read (synthetic tokens of the asked shape) and the recipe's
  -- own log lines stay quiet
  local data = require "fsdp.data"
  local was_synthetic = data.synthetic(opts.synthetic_data ~= false)
  local was_quiet = require("fsdp.distributed")._set_quiet(true)
  -- every sharded model the run makes, for the plan's unit list
  local shard_mod = require "fsdp.shard"
  local real_shard = shard_mod.shard
  local sharded = {}
  shard_mod.shard = function(...)
    local s = real_shard(...)
    sharded[#sharded + 1] = s
    return s
  end
  fsdp.memory.empty_cache("meta")
  fsdp.memory.reset_peak("meta")
  fsdp.memory.reset_peak("cpu")
  local base, base_host = memory_now("meta"), memory_now("cpu")
  local result = { steps = {}, mimic = mimic, steps_run = 0 }
  local progress = opts.progress or function() end
  progress(0, steps)
  local in_backward = { flops = 0, launches = 0, bytes = 0 }   -- this step's backward walks
  local t0 = traffic_now(world_group.comm)
  meta.reset()
  C.fsdp_timeline_record(1)   -- each step's kernel calls, issues and waits in order (fsdp.plan_time)
  local function close_step()
    local k = result.steps_run + 1
    local t1 = traffic_now(world_group.comm)
    local timeline = require("fsdp.plan_time").read_timeline()
    C.fsdp_timeline_record(1)   -- (cleared: the next step's)
    result.steps[k] = {
      timeline = timeline,
      kernels = meta.counts(),
      traffic = traffic_between(t0, t1),
      memory = memory_since(base, memory_now("meta")),
      host = memory_since(base_host, memory_now("cpu")),
      backward = { flops = in_backward.flops, launches = in_backward.launches, bytes = in_backward.bytes },
    }
    in_backward.flops, in_backward.launches, in_backward.bytes = 0, 0, 0
    result.steps_run = k
    t0 = t1
    meta.reset()
    progress(math.min(k, steps), steps)
    return k
  end
  -- the work of backward walks, apart: activation recomputation shows as
  -- forward work inside them
  local autograd = require "fsdp.autograd"
  local real_backward = autograd.backward
  local depth = 0   -- (recomputation runs nested backward walks: the outermost one counts)
  autograd.backward = function(...)
    if depth > 0 then return real_backward(...) end
    progress(result.steps_run + 0.5, steps)   -- this step's forward is done
    depth = depth + 1
    local a = meta.totals()
    local res = { pcall(real_backward, ...) }
    depth = depth - 1
    local b = meta.totals()
    in_backward.flops = in_backward.flops + b.flops - a.flops
    in_backward.launches = in_backward.launches + b.launches - a.launches
    in_backward.bytes = in_backward.bytes + (b.bytes_read + b.bytes_written) - (a.bytes_read + a.bytes_written)
    if not res[1] then error(res[2], 0) end
    return unpack(res, 2)
  end
  local hook = function()
    if close_step() >= steps then error(M.STOP, 0) end
  end
  table.insert(optim.after_step, hook)
  fsdp.set_default_device("meta")
  local args = { ... }
  local ok, err
  M.deterministic(function()
    ok, err = xpcall(function() return fn(unpack(args)) end, function(e)
      if e == M.STOP or type(e) ~= "string" then return e end   -- (usage errors are tables)
      return debug.traceback(tostring(e), 2)
    end)
  end)
  for i = #optim.after_step, 1, -1 do
    if optim.after_step[i] == hook then table.remove(optim.after_step, i) end
  end
  C.fsdp_timeline_record(0)
  shard_mod.shard = real_shard
  autograd.backward = real_backward
  data.synthetic(was_synthetic)
  require("fsdp.distributed")._set_quiet(was_quiet)
  fsdp.set_default_device(prev_device)
  result.sharded = sharded
  if result.steps_run == 0 then   -- no fsdp.optim step: the whole run counts as one
    result.whole_run = true
    close_step()
  end
  -- as the last counted step ended (what fn did after it is not counted)
  result.memory = result.steps[result.steps_run].memory
  result.host = result.steps[result.steps_run].host
  leave_world()
  if not ok and err ~= M.STOP then
    progress(nil, steps)
    error(err, 0)
  end
  if result.whole_run then progress(steps, steps) end
  return result
end

--- Sums of kernel counts by family over a step's list (fsdp.meta.counts).
function M.by_family(kernels)
  local fam, order = {}, {}
  for _, e in ipairs(kernels) do
    local f = fam[e.family]
    if not f then
      f = { family = e.family, calls = 0, bytes_read = 0, bytes_written = 0, flops = 0, launches = 0, syncs = 0,
        bytes_l2 = 0, entries = {} }
      fam[e.family] = f
      order[#order + 1] = f
    end
    for _, k in ipairs({ "calls", "bytes_read", "bytes_written", "flops", "launches", "syncs", "bytes_l2" }) do
      f[k] = f[k] + (e[k] or 0)
    end
    f.entries[#f.entries + 1] = e
  end
  return order
end

return M
