-- fsdp.meta: the counting device ("meta"), where kernels compute nothing and
-- count what they would cost: calls, bytes read and written, FLOPs, kernel
-- launches and host syncs per kernel table entry. Its allocator is the
-- engine's caching allocator, so fsdp.memory.stats(tag, "meta") are the
-- figures a real run would see.
--
--   local meta = require "fsdp.meta"
--   meta.mimic("cuda")                 -- the CUDA table's kernel set (bf16 matmul native, ...)
--   fsdp.set_default_device("meta")
--   ... run steps ...
--   for _, e in ipairs(meta.counts()) do print(e.name, e.calls, e.bytes_read, e.flops) end
local ffi = require "ffi"
local core = require "fsdp.core"

local C, raise = core.C, core.raise

local M = {}

--- Offer the kernel set of "cpu" (the default) or "cuda".
function M.mimic(device)
  if C.fsdp_meta_mimic(core.device_id(device or "cpu")) ~= 0 then raise() end
end

--- The device whose kernel set the meta device offers now.
function M.mimicked()
  local box = ffi.new("int[1]")
  if C.fsdp_meta_mimicked(box) ~= 0 then raise() end
  return core.device_names[box[0]]
end

--- Zeroes every counter.
function M.reset()
  if C.fsdp_meta_reset() ~= 0 then raise() end
end

local name_box, family_box = ffi.new("const char *[1]"), ffi.new("const char *[1]")
local present_box, counters = ffi.new("int[1]"), ffi.new("int64_t[7]")

--- Every entry, in table order: { name, family, present, calls, bytes_read,
-- bytes_written, flops, launches, syncs, bytes_l2 } (bytes_l2: the part of
-- bytes_read that the entry's stated L2 rule serves from L2).
function M.counts()
  local n = ffi.new("int[1]")
  if C.fsdp_meta_entry_count(n) ~= 0 then raise() end
  local list = {}
  for i = 0, n[0] - 1 do
    if C.fsdp_meta_entry(i, name_box, family_box, present_box, counters) ~= 0 then raise() end
    list[#list + 1] = {
      name = ffi.string(name_box[0]), family = ffi.string(family_box[0]), present = present_box[0] ~= 0,
      calls = tonumber(counters[0]), bytes_read = tonumber(counters[1]), bytes_written = tonumber(counters[2]),
      flops = tonumber(counters[3]), launches = tonumber(counters[4]), syncs = tonumber(counters[5]),
      bytes_l2 = tonumber(counters[6]),
    }
  end
  return list
end

--- The counts by entry name.
function M.by_name()
  local t = {}
  for _, e in ipairs(M.counts()) do t[e.name] = e end
  return t
end

--- Sums over every entry: { calls, bytes_read, bytes_written, flops, launches, syncs }.
function M.totals()
  local t = { calls = 0, bytes_read = 0, bytes_written = 0, flops = 0, launches = 0, syncs = 0 }
  for _, e in ipairs(M.counts()) do
    for k in pairs(t) do t[k] = t[k] + e[k] end
  end
  return t
end

return M
