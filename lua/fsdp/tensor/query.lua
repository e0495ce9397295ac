-- fsdp.tensor.query: what a tensor is, asked of the engine (dims, shape,
-- strides, dtype, element count, device), shapes as callers write them,
-- and a tensor's values read into Lua numbers. Shared by the parts of
-- fsdp.tensor (constructors, methods, printing); not a public module.

local ffi = require "ffi"
local core = require "fsdp.core"

local C = core.C
local raise, wrap, out = core.raise, core.wrap, core.out
local tonumber, type, select = tonumber, type, select
local fmt = string.format

local int_box = ffi.new("int[1]")
local i64_box = ffi.new("int64_t[1]")
local ptr_box = ffi.new("void *[1]")
local cptr_box = ffi.new("const void *[1]")
local dims8 = ffi.new("int64_t[8]")

local M = {}

local elem_ctype = { [0] = "float", "uint16_t", "int32_t", "int64_t", "uint16_t" }
local elem_size = { [0] = 4, 2, 4, 8, 2 }
local elem_ptr_t = {}
local elem_array_t = {}
for id, ct in pairs(elem_ctype) do
  elem_ptr_t[id] = ffi.typeof(ct .. " *")
  elem_array_t[id] = ffi.typeof(ct .. "[?]")
end

-- bf16 is the high half of an f32.
local bf16_union = ffi.new("union { uint16_t h[2]; float f; }")
local bf16_hi = ffi.abi("le") and 1 or 0
local function bf16_value(h)
  bf16_union.h[1 - bf16_hi] = 0
  bf16_union.h[bf16_hi] = h
  return bf16_union.f
end
M.elem_size, M.elem_ptr_t, M.elem_array_t, M.bf16_value = elem_size, elem_ptr_t, elem_array_t, bf16_value

local function int64s(list, n)
  local a = ffi.new("int64_t[?]", n > 0 and n or 1)
  for i = 1, n do a[i - 1] = list[i] end
  return a
end

-- Shapes come as (n1, n2, ..., [opts]) or ({n1, n2, ...}, [opts]).
local function parse_shape(what, ...)
  local first = ...
  if type(first) == "table" then return first, (select(2, ...)) end
  local dims, opts = {}, nil
  local n = select("#", ...)
  for i = 1, n do
    local v = select(i, ...)
    if type(v) == "number" then
      dims[#dims + 1] = v
    elseif type(v) == "table" and i == n then
      opts = v
    elseif v ~= nil then
      raise(what .. ": expected sizes (numbers) or a shape table, got " .. type(v))
    end
  end
  return dims, opts
end

local function ndim(t)
  if C.fsdp_tensor_ndim(t, int_box) ~= 0 then raise() end
  return int_box[0]
end

local desc_buf = ffi.new("char[256]")
local function describe(t)
  if C.fsdp_tensor_describe(t, desc_buf, 256) ~= 0 then raise() end
  return ffi.string(desc_buf)
end

-- A 1-based or negative Lua dim to the engine's 0-based one, checked here
-- so that messages speak of dims as the caller numbered them.
local function cdim(t, d, what, n)
  if type(d) ~= "number" then raise(what .. ": dim must be a number, got " .. type(d)) end
  n = n or ndim(t)
  if d >= 1 and d <= n then return d - 1 end
  if d <= -1 and d >= -n then return n + d end
  raise(fmt("%s(%s): dim %s out of range (dims are 1..%d, or -%d..-1 from the end)", what, describe(t), tostring(d), n, n))
end

local function dtype_of(t)
  if C.fsdp_tensor_dtype(t, int_box) ~= 0 then raise() end
  return int_box[0]
end

local function numel(t)
  if C.fsdp_tensor_numel(t, i64_box) ~= 0 then raise() end
  return tonumber(i64_box[0])
end

local function shape_of(t)
  local n = ndim(t)
  if C.fsdp_tensor_shape(t, dims8) ~= 0 then raise() end
  local s = {}
  for i = 1, n do s[i] = tonumber(dims8[i - 1]) end
  return s
end

local function strides_of(t)
  local n = ndim(t)
  if C.fsdp_tensor_strides(t, dims8) ~= 0 then raise() end
  local s = {}
  for i = 1, n do s[i] = tonumber(dims8[i - 1]) end
  return s
end

local function device_id_of(t)
  if C.fsdp_tensor_device(t, int_box) ~= 0 then raise() end
  return int_box[0]
end

-- The values, contiguous, as Lua numbers flat[1..n].
local function to_flat(t)
  local dt, n = dtype_of(t), numel(t)
  local buf = elem_array_t[dt](n > 0 and n or 1)
  if C.fsdp_tensor_to_data(t, buf, n * elem_size[dt]) ~= 0 then raise() end
  local flat = {}
  if dt == 1 then
    for i = 0, n - 1 do flat[i + 1] = bf16_value(buf[i]) end
  else
    for i = 0, n - 1 do flat[i + 1] = tonumber(buf[i]) end
  end
  return flat
end

-- Element reader: read(offset in elements) -> number, and the strides to
-- use. Host tensors are read in place; a tensor elsewhere (CUDA) is copied
-- to a host tensor first, whole, which the reader then holds on to.
local function element_reader(t)
  if device_id_of(t) ~= 0 then   -- a host copy, as t:to("cpu") makes
    if C.fsdp_tensor_to_device(out, t, core.device_id("cpu")) ~= 0 then raise() end
    t = wrap()
  end
  local dt = dtype_of(t)
  if C.fsdp_tensor_read_ptr(t, cptr_box) ~= 0 then raise() end   -- reading: nothing goes stale
  local p = ffi.cast(elem_ptr_t[dt], cptr_box[0])
  local read
  if dt == 1 then
    read = function(off) local _ = t; return bf16_value(p[off]) end
  else
    read = function(off) local _ = t; return tonumber(p[off]) end
  end
  return read, strides_of(t)
end

M.int64s, M.parse_shape, M.ndim, M.describe, M.cdim = int64s, parse_shape, ndim, describe, cdim
M.dtype_of, M.numel, M.shape_of, M.strides_of, M.device_id_of = dtype_of, numel, shape_of, strides_of, device_id_of
M.to_flat, M.element_reader = to_flat, element_reader

return M
