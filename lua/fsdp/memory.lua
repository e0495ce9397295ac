-- fsdp.memory: the engine allocator's statistics per tag, its cap and cache.
--
--   fsdp.memory.stats()        -- totals: {current=, peak=, reserved=} in bytes
--   fsdp.memory.stats("grad")  -- one tag: param, grad, optimizer, activation, comm, other
--   fsdp.memory.set_cap(2^30)  -- later allocations over 1 GiB fail (0 or nil: no cap)

local ffi = require "ffi"
local core = require "fsdp.core"

local C, raise, tag_id, device_id = core.C, core.raise, core.tag_id, core.device_id

local M = {}
M.tags = { "param", "grad", "optimizer", "activation", "comm", "other" }

local cur, peak, res = ffi.new("int64_t[1]"), ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
local int_box = ffi.new("int[1]")

function M.stats(tag, device)
  if C.fsdp_mem_stats(device_id(device), tag_id(tag, -1), cur, peak, res) ~= 0 then raise() end
  return { current = tonumber(cur[0]), peak = tonumber(peak[0]), reserved = tonumber(res[0]) }
end

--- Every tag's stats and the totals, by name.
function M.all(device)
  local t = { total = M.stats(nil, device) }
  for _, name in ipairs(M.tags) do t[name] = M.stats(name, device) end
  return t
end

function M.reset_peak(device)
  if C.fsdp_mem_reset_peak(device_id(device)) ~= 0 then raise() end
end

function M.set_cap(bytes, device)
  if C.fsdp_mem_set_cap(device_id(device), bytes or 0) ~= 0 then raise() end
end

function M.get_cap(device)
  if C.fsdp_mem_get_cap(device_id(device), cur) ~= 0 then raise() end
  return tonumber(cur[0])
end

function M.empty_cache(device)
  if C.fsdp_mem_empty_cache(device_id(device)) ~= 0 then raise() end
end

--- Tag for tensors made by ops on this thread from now on; returns the previous one.
function M.set_default_tag(tag)
  if C.fsdp_mem_set_default_tag(tag_id(tag, 3), int_box) ~= 0 then raise() end
  return core.tag_names[int_box[0]]
end

return M
