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
-- fsdp.distributed answers them; the default is a world of one).
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
local dbl = ffi.new("double[1]")

local function traffic_now()
  if C.fsdp_comm_stats(i64, i64 + 1, dbl) ~= 0 then raise() end
  return { gathered_bytes = tonumber(i64[0]), reduced_bytes = tonumber(i64[1]) }
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

--- Runs fn(...) on the meta device until `steps` optimizer steps are done
-- (or fn returns). Returns { steps = { [k] = { kernels, traffic } },
-- memory = { [tag] = { peak, current, reserved } }, host = the same for the
-- CPU allocator, steps_run, mimic }.
function M.run(fn, opts, ...)
  opts = opts or {}
  local steps, mimic = check_opts(opts)
  local prev_device = fsdp.default_device()
  meta.mimic(mimic)
  fsdp.memory.empty_cache("meta")
  fsdp.memory.reset_peak("meta")
  fsdp.memory.reset_peak("cpu")
  local base, base_host = memory_now("meta"), memory_now("cpu")
  local result = { steps = {}, mimic = mimic, steps_run = 0 }
  local t0 = traffic_now()
  meta.reset()
  local function close_step()
    local k = result.steps_run + 1
    local t1 = traffic_now()
    result.steps[k] = {
      kernels = meta.counts(),
      traffic = { gathered_bytes = t1.gathered_bytes - t0.gathered_bytes,
        reduced_bytes = t1.reduced_bytes - t0.reduced_bytes },
      memory = memory_since(base, memory_now("meta")),
    }
    result.steps_run = k
    t0 = t1
    meta.reset()
    return k
  end
  local hook = function()
    if close_step() >= steps then error(M.STOP, 0) end
  end
  table.insert(optim.after_step, hook)
  fsdp.set_default_device("meta")
  local args = { ... }
  local ok, err = xpcall(function() return fn(unpack(args)) end, function(e)
    if e == M.STOP then return e end
    return debug.traceback(tostring(e), 2)
  end)
  for i = #optim.after_step, 1, -1 do
    if optim.after_step[i] == hook then table.remove(optim.after_step, i) end
  end
  fsdp.set_default_device(prev_device)
  if not ok and err ~= M.STOP then error(err, 0) end
  result.memory = memory_since(base, memory_now("meta"))
  result.host = memory_since(base_host, memory_now("cpu"))
  if result.steps_run < steps then close_step() end   -- what ran after the last optimizer step
  return result
end

--- Sums of kernel counts by family over a step's list (fsdp.meta.counts).
function M.by_family(kernels)
  local fam, order = {}, {}
  for _, e in ipairs(kernels) do
    local f = fam[e.family]
    if not f then
      f = { family = e.family, calls = 0, bytes_read = 0, bytes_written = 0, flops = 0, launches = 0, syncs = 0,
        entries = {} }
      fam[e.family] = f
      order[#order + 1] = f
    end
    for _, k in ipairs({ "calls", "bytes_read", "bytes_written", "flops", "launches", "syncs" }) do
      f[k] = f[k] + e[k]
    end
    f.entries[#f.entries + 1] = e
  end
  return order
end

return M
