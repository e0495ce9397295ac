-- fsdp.core: the binding to libfsdp and the few helpers every module shares.
--
-- Every engine call returns a status (0 = OK) and leaves a message naming
-- the op, shapes, dtypes, device and rank in fsdp_last_error(); raise()
-- turns that into a Lua error reported at the user's line, not at ours.

local ffi = require "ffi"

ffi.cdef(require "fsdp.cdef")

-- Under the fsdp-lua launcher the engine is linked into the executable and
-- its symbols are visible through ffi.C; under plain luajit, load the library.
local C
do
  local linked = pcall(function() return ffi.C.fsdp_version end)
  C = linked and ffi.C or ffi.load(os.getenv("FSDP_LIB") or "fsdp")
end

local M = { C = C, ffi = ffi }

local last_error = C.fsdp_last_error
local getinfo = debug.getinfo

-- Frames whose source lies in this folder belong to the library.
local libdir = "@" .. (getinfo(1, "S").source:match("^@(.*/)") or "")

-- Level (counted from raise's caller's caller, as error() counts) of the
-- first stack frame outside the library: where the user made the call.
local function user_level()
  local level = 3
  while true do
    local info = getinfo(level, "S")
    if not info then return 0 end
    if info.what ~= "C" and info.source:sub(1, #libdir) ~= libdir then return level - 1 end
    level = level + 1
  end
end

-- Raises the engine's last error (or msg) at the user's level.
local function raise(msg)
  msg = msg or ffi.string(last_error())
  local level = user_level()
  error(msg, level > 0 and level or 0)
end
M.raise = raise

-- check(status, ...) returns ... when status is 0, else raises.
function M.check(st, ...)
  if st ~= 0 then raise() end
  return ...
end

-- ---- enums by name ----

M.dtype_names = { [0] = "f32", "bf16", "i32", "i64", "u16" }
local dtype_ids = {
  f32 = 0, float32 = 0, float = 0,
  bf16 = 1, bfloat16 = 1,
  i32 = 2, int32 = 2, int = 2,
  i64 = 3, int64 = 3, long = 3,
  u16 = 4, uint16 = 4,
}
function M.dtype_id(d, default)
  if d == nil then return default or 0 end
  local id = dtype_ids[d]
  if id then return id end
  if type(d) == "number" and M.dtype_names[d] then return d end
  raise("unknown dtype " .. tostring(d) .. " (expected f32, bf16, i32, i64 or u16)")
end
M.dtype_is_float = { [0] = true, [1] = true }

M.tag_names = { [0] = "param", "grad", "optimizer", "activation", "comm", "other" }
local tag_ids = { param = 0, grad = 1, optimizer = 2, activation = 3, comm = 4, other = 5 }
function M.tag_id(tag, default)
  if tag == nil then return default end
  local id = tag_ids[tag]
  if id then return id end
  if type(tag) == "number" and M.tag_names[tag] then return tag end
  raise("unknown memory tag " .. tostring(tag) ..
        " (expected param, grad, optimizer, activation, comm or other)")
end

M.device_names = { [0] = "cpu", "cuda", "meta" }
local default_box = ffi.new("int[1]")
--- A device name or id as the engine's id; nil means the default device
-- (CUDA when built and a GPU is there, else the CPU).
function M.device_id(d)
  if d == nil then
    if C.fsdp_default_device(default_box) ~= 0 then M.raise() end
    return default_box[0]
  end
  if d == "cpu" or d == 0 then return 0 end
  if d == "cuda" or d == 1 then return 1 end
  if d == "meta" or d == 2 then return 2 end
  raise("unknown device " .. tostring(d) .. " (expected cpu, cuda or meta)")
end

-- ---- tensor handles ----

M.tensor_ptr = ffi.typeof("fsdp_tensor *")
local release = C.fsdp_tensor_release
M.release = release
local ffi_gc = ffi.gc

-- One out-box for the many calls that return a new tensor. Calls never
-- nest between filling it and wrap() emptying it.
local out = ffi.new("fsdp_tensor *[1]")
M.out = out

-- Engine memory is invisible to Lua's collector, which counts only the few
-- bytes of each handle: left alone it would let dead tensors pile up for
-- gigabytes. So every 64 new handles we look at the engine's bytes in use,
-- and collect when they have grown by half (and 16 MiB) since the last
-- collection, or after 4096 handles regardless. A collection is cheap: the
-- Lua heap is small.
local collectgarbage = collectgarbage
-- A full collection that leaves a stopped collector stopped: LuaJIT's
-- restarts it (a full cycle resets the step threshold), and then
-- incremental steps, paced by Lua allocations, would free dead handles at
-- moments no two programs share (fsdp.dryrun.deterministic stops it so that
-- a plan and a real run free them at the same points).
local function full_collect()
  local running = collectgarbage("isrunning")
  collectgarbage()
  if not running then collectgarbage("stop") end
end
M.full_collect = full_collect
local made, since_check = 0, 0
local in_use = ffi.new("int64_t[1]")
local dev_box = ffi.new("int[1]")
local after_gc = 0
-- bytes in use on the default device, where new tensors go (a GPU's, or
-- the counting device's in a dry run)
local function engine_bytes()
  C.fsdp_default_device(dev_box)
  C.fsdp_mem_stats(dev_box[0], -1, in_use, nil, nil)
  return tonumber(in_use[0])
end
local function maybe_collect()
  since_check = 0
  local now = engine_bytes()
  if made >= 4096 or now > after_gc * 1.5 + 16 * 2 ^ 20 then
    made = 0
    full_collect()
    after_gc = engine_bytes()
  end
end
M.collect = function()
  made = 0
  full_collect()
  after_gc = engine_bytes()
end
-- The handle counts that time those checks, to run a program again from
-- the same point (the planner's runs of one recipe as each rank).
M.collect_counts = function() return { made = made, since_check = since_check } end
M.set_collect_counts = function(c) made, since_check = c.made, c.since_check end

-- The new reference in out[0], owned by the Lua GC from now on.
function M.wrap()
  local p = out[0]
  out[0] = nil
  made, since_check = made + 1, since_check + 1
  if since_check >= 64 then maybe_collect() end
  return ffi_gc(p, release)
end

-- Same, but nil for a NULL result (e.g. no gradient yet).
function M.wrap_or_nil()
  local p = out[0]
  if p == nil then return nil end
  out[0] = nil
  made = made + 1
  return ffi_gc(p, release)
end

-- Tensors given back early with :free(). Weak keys: the cdata object is the
-- identity, so a later tensor at the same address is not affected.
M.freed = setmetatable({}, { __mode = "k" })

local istype = ffi.istype
local tensor_ptr = M.tensor_ptr
local freed = M.freed

-- Validates a tensor argument: right type, not freed.
function M.T(x, what)
  if not istype(tensor_ptr, x) then
    raise((what or "argument") .. ": expected a tensor, got " .. type(x))
  end
  if freed[x] then raise((what or "argument") .. ": tensor was freed with :free()") end
  return x
end

return M
