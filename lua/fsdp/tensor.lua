-- fsdp.tensor: the Tensor type, a metatype over the engine's opaque
-- `struct fsdp_tensor`. A Lua tensor is an `fsdp_tensor *` holding one
-- reference, given back by its ffi.gc finalizer or early by :free().
--
-- Conventions (Torch7's): dims and indices are 1-based; a negative dim
-- counts from the end (-1 is the last). Shapes are Lua tables of numbers.
--
-- t[i] is not offered: LuaJIT treats a numeric key on a pointer as pointer
-- indexing before consulting __index (an error for an opaque struct), and
-- giving the struct a size would turn t + 1 into pointer arithmetic. Use
-- t:select(dim, i) (a view) or t:at(i, j, ...) (a number) instead.
--
-- The op wrappers call through the C namespace (not cached function
-- pointers): the JIT compiles namespace calls to direct calls.

local ffi = require "ffi"
local bit = require "bit"
local core = require "fsdp.core"
local autograd = require "fsdp.autograd"

local C = core.C
local raise, wrap, wrap_or_nil, T = core.raise, core.wrap, core.wrap_or_nil, core.T
local out = core.out
local freed = core.freed
local istype, tensor_ptr = ffi.istype, core.tensor_ptr
local dtype_names, dtype_id, tag_id, device_id = core.dtype_names, core.dtype_id, core.tag_id, core.device_id
local tonumber, type, select, floor, abs = tonumber, type, select, math.floor, math.abs
local fmt, concat = string.format, table.concat

local int_box = ffi.new("int[1]")
local i64_box = ffi.new("int64_t[1]")
local dbl_box = ffi.new("double[1]")
local ptr_box = ffi.new("void *[1]")
local dims8 = ffi.new("int64_t[8]")

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

local M = {}            -- module functions (fsdp.zeros, ...)
local methods = {}      -- tensor methods
local mt = {}           -- the metatable
M.methods = methods

-- ---- small helpers ----

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

-- ---- constructors ----

local function set_requires_grad(t, on)
  if C.fsdp_tensor_set_requires_grad(t, on and 1 or 0) ~= 0 then raise() end
  return t
end

local function finish(t, opts)
  if opts and opts.requires_grad then set_requires_grad(t, true) end
  return t
end

-- ---- devices ----

--- fsdp.default_device() -> "cpu" or "cuda": where tensors go when opts.device
-- is not given (CUDA when it is built in and this rank has a GPU).
local function default_device_id()
  if C.fsdp_default_device(int_box) ~= 0 then raise() end
  return int_box[0]
end
function M.default_device() return core.device_names[default_device_id()] end

--- fsdp.set_default_device(name): "cpu" or "cuda" (an error when that
-- device is not built in or has no hardware).
function M.set_default_device(d)
  if C.fsdp_set_default_device(device_id(d)) ~= 0 then raise() end
end

-- opts.device, or the default device.
local function device_of_opts(opts)
  local d = opts and opts.device
  if d == nil then return default_device_id() end
  return device_id(d)
end

local function new_tensor(zero, dims, opts)
  local n = #dims
  local dt = dtype_id(opts and opts.dtype)
  local tag = tag_id(opts and opts.tag, 5)
  local dev = device_of_opts(opts)
  local st
  if zero then
    st = C.fsdp_tensor_zeros(out, dt, n, int64s(dims, n), dev, tag)
  else
    st = C.fsdp_tensor_empty(out, dt, n, int64s(dims, n), dev, tag)
  end
  if st ~= 0 then raise() end
  return wrap()
end

--- fsdp.empty(sizes..., opts) / fsdp.empty({sizes}, opts): uninitialized.
-- opts: dtype ("f32"), tag ("other"), device (fsdp.default_device()), requires_grad.
function M.empty(...)
  local dims, opts = parse_shape("fsdp.empty", ...)
  return finish(new_tensor(false, dims, opts), opts)
end

function M.zeros(...)
  local dims, opts = parse_shape("fsdp.zeros", ...)
  return finish(new_tensor(true, dims, opts), opts)
end

function M.ones(...)
  local dims, opts = parse_shape("fsdp.ones", ...)
  local t = new_tensor(false, dims, opts)
  if C.fsdp_fill(t, 1) ~= 0 then raise() end
  return finish(t, opts)
end

--- fsdp.full(shape, value, opts): shape a table (or one number for 1-D).
function M.full(shape, value, opts)
  if type(shape) == "number" then shape = { shape } end
  if type(value) ~= "number" then raise("fsdp.full: value must be a number, got " .. type(value)) end
  local t = new_tensor(false, shape, opts)
  if C.fsdp_fill(t, value) ~= 0 then raise() end
  return finish(t, opts)
end

-- Random init: element i depends only on (seed, stream, offset + i).
-- Without a seed, fsdp.manual_seed's seed is used and each call takes the
-- next stream, so two calls give different values, reproducibly.
local rng = { seed = 0, stream = 0 }
function M.manual_seed(seed)
  -- checked here: a bad seed would otherwise break every later randn
  if type(seed) ~= "number" or seed ~= seed or seed < 0 or seed >= 2 ^ 53 or seed ~= math.floor(seed) then
    raise("fsdp.manual_seed: seed must be a whole number in 0..2^53, got " .. tostring(seed) .. " (" .. type(seed) ..
      ")")
  end
  rng.seed, rng.stream = seed, 0
end

local function rng_args(opts)
  local seed, stream = opts and opts.seed, opts and opts.stream
  if seed == nil then
    seed = rng.seed
    if stream == nil then
      stream = rng.stream
      rng.stream = rng.stream + 1
    end
  end
  return seed, stream or 0, opts and opts.offset or 0
end

--- fsdp.randn(sizes..., {seed=, stream=, offset=, mean=0, std=1, dtype=})
function M.randn(...)
  local dims, opts = parse_shape("fsdp.randn", ...)
  local t = new_tensor(false, dims, opts)
  local seed, stream, offset = rng_args(opts)
  if C.fsdp_init_normal(t, opts and opts.mean or 0, opts and opts.std or 1, seed, stream, offset) ~= 0 then
    raise()
  end
  return finish(t, opts)
end

--- fsdp.rand(sizes..., {low=0, high=1, seed=, stream=, offset=}): uniform.
function M.rand(...)
  local dims, opts = parse_shape("fsdp.rand", ...)
  local t = new_tensor(false, dims, opts)
  local seed, stream, offset = rng_args(opts)
  if C.fsdp_init_uniform(t, opts and opts.low or 0, opts and opts.high or 1, seed, stream, offset) ~= 0 then
    raise()
  end
  return finish(t, opts)
end

-- A tensor holding Lua numbers flat[1..n], copied in.
local function from_flat(flat, n, dims, opts)
  local dt = dtype_id(opts and opts.dtype)
  local tag = tag_id(opts and opts.tag, 5)
  local dev = device_of_opts(opts)
  local nd = #dims
  -- bf16 goes in as f32 and is rounded by the engine's cast.
  local load_dt = dt == 1 and 0 or dt
  local buf = elem_array_t[load_dt](n > 0 and n or 1)
  for i = 1, n do buf[i - 1] = flat[i] end
  if C.fsdp_tensor_from_data(out, load_dt, nd, int64s(dims, nd), buf, n * elem_size[load_dt], dev, tag) ~= 0 then
    raise()
  end
  local t = wrap()
  if load_dt ~= dt then   -- a converting copy keeps the tag and device
    local r = new_tensor(false, dims, { dtype = dt, tag = tag, device = dev })
    if C.fsdp_copy(r, t) ~= 0 then raise() end
    t = r
  end
  return finish(t, opts)
end

local function flatten(data, dims, depth, flat)
  local n = #data
  if n ~= dims[depth] then
    raise(fmt("fsdp.tensor: ragged nested table (size %d at depth %d, expected %d)", n, depth, dims[depth]))
  end
  if depth == #dims then
    for i = 1, n do
      local v = data[i]
      if type(v) ~= "number" then
        raise("fsdp.tensor: expected numbers, got " .. type(v) .. " at depth " .. depth)
      end
      flat[#flat + 1] = v
    end
  else
    for i = 1, n do
      if type(data[i]) ~= "table" then raise("fsdp.tensor: ragged nested table at depth " .. depth) end
      flatten(data[i], dims, depth + 1, flat)
    end
  end
end

--- fsdp.tensor(value | nested table, opts) or fsdp.tensor(flat table, shape, opts)
function M.tensor(data, shape, opts)
  if type(shape) == "table" and #shape == 0 then shape, opts = nil, shape end
  if type(data) == "number" then return from_flat({ data }, 1, shape or {}, opts) end
  if type(data) ~= "table" then raise("fsdp.tensor: expected a number or a table, got " .. type(data)) end
  if shape then
    local n = 1
    for i = 1, #shape do n = n * shape[i] end
    if n ~= #data then
      raise(fmt("fsdp.tensor: %d values do not fill shape (%s)", #data, concat(shape, ", ")))
    end
    return from_flat(data, n, shape, opts)
  end
  local dims, x = {}, data
  while type(x) == "table" do
    dims[#dims + 1] = #x
    x = x[1]
  end
  local flat = {}
  flatten(data, dims, 1, flat)
  return from_flat(flat, #flat, dims, opts)
end

local ARANGE_MAX = 2 ^ 27   -- values are built in a Lua table first

--- fsdp.arange(n) = 0..n-1, fsdp.arange(a, b [, step]) = a, a+step, ... < b.
function M.arange(a, b, step, opts)
  if type(b) == "table" then b, opts = nil, b end
  if type(step) == "table" then step, opts = nil, step end
  if b == nil then a, b = 0, a end
  step = step or 1
  for _, x in ipairs({ { "start", a }, { "stop", b }, { "step", step } }) do
    local v = x[2]
    if type(v) ~= "number" or v ~= v or v == math.huge or v == -math.huge then
      raise("fsdp.arange: " .. x[1] .. " must be a finite number, got " .. tostring(v) .. " (" .. type(v) .. ")")
    end
  end
  if step == 0 then raise("fsdp.arange: step is 0") end
  -- the values are built in a Lua table: refuse sizes it cannot hold before building it
  local count = math.max(0, math.ceil((b - a) / step))
  if count > ARANGE_MAX then
    raise(string.format("fsdp.arange(%.17g, %.17g, %.17g): %.17g elements, at most %d (2^27)", a, b, step, count,
      ARANGE_MAX))
  end
  local flat, v = {}, a
  while (step > 0 and v < b) or (step < 0 and v > b) do
    flat[#flat + 1] = v
    v = a + #flat * step
  end
  return from_flat(flat, #flat, { #flat }, opts)
end

function M.is_tensor(x)
  return istype(tensor_ptr, x) and not freed[x]
end

-- ---- inspection ----

function methods.dim(t) return ndim(t) end
methods.ndim = methods.dim
function methods.numel(t) return numel(t) end
function methods.shape(t) return shape_of(t) end
function methods.strides(t) return strides_of(t) end

function methods.size(t, d)
  if d == nil then return shape_of(t) end
  local cd = cdim(t, d, "size")
  if C.fsdp_tensor_shape(t, dims8) ~= 0 then raise() end
  return tonumber(dims8[cd])
end

function methods.dtype(t) return dtype_names[dtype_of(t)] end

function methods.device(t)
  if C.fsdp_tensor_device(t, int_box) ~= 0 then raise() end
  return core.device_names[int_box[0]]
end

function methods.tag(t)
  if C.fsdp_tensor_tag(t, int_box) ~= 0 then raise() end
  return core.tag_names[int_box[0]]
end

function methods.is_contiguous(t)
  if C.fsdp_tensor_is_contiguous(t, int_box) ~= 0 then raise() end
  return int_box[0] ~= 0
end

function methods.item(t)
  if C.fsdp_tensor_item(t, dbl_box) ~= 0 then raise() end
  return dbl_box[0]
end

function methods.describe(t) return describe(t) end

function methods.data_ptr(t)
  if C.fsdp_tensor_data_ptr(t, ptr_box) ~= 0 then raise() end
  return ptr_box[0]
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

local function nest(flat, dims, depth, pos)
  local res, n = {}, dims[depth]
  if depth == #dims then
    for i = 1, n do res[i] = flat[pos + i] end
    return res, pos + n
  end
  for i = 1, n do res[i], pos = nest(flat, dims, depth + 1, pos) end
  return res, pos
end

--- t:tolist(): nested Lua tables (a number for a 0-D tensor).
function methods.tolist(t)
  local flat, dims = to_flat(t), shape_of(t)
  if #dims == 0 then return flat[1] end
  return (nest(flat, dims, 1, 0))
end

local function device_id_of(t)
  if C.fsdp_tensor_device(t, int_box) ~= 0 then raise() end
  return int_box[0]
end

-- Element reader: read(offset in elements) -> number, and the strides to
-- use. Host tensors are read in place; a tensor elsewhere (CUDA) is copied
-- to a host tensor first, whole, which the reader then holds on to.
local function element_reader(t)
  if device_id_of(t) ~= 0 then t = methods.to(t, "cpu") end
  local dt = dtype_of(t)
  if C.fsdp_tensor_data_ptr(t, ptr_box) ~= 0 then raise() end
  local p = ffi.cast(elem_ptr_t[dt], ptr_box[0])
  local read
  if dt == 1 then
    read = function(off) local _ = t; return bf16_value(p[off]) end
  else
    read = function(off) local _ = t; return tonumber(p[off]) end
  end
  return read, strides_of(t)
end

--- t:at(i, j, ...): the value at 1-based indices (a CUDA tensor is copied
-- to the host first: slow in a loop; use t:cpu() once, then :at).
function methods.at(t, ...)
  local dims = shape_of(t)
  local n = select("#", ...)
  if n ~= #dims then raise(fmt("at: %d indices for a %d-D tensor", n, #dims)) end
  local read, strides = element_reader(t)
  local off = 0
  for d = 1, n do
    local i = select(d, ...)
    if i < 0 then i = dims[d] + i + 1 end
    if i < 1 or i > dims[d] then
      raise(fmt("at: index %d out of range for dim %d of size %d", i, d, dims[d]))
    end
    off = off + (i - 1) * strides[d]
  end
  return read(off)
end

-- ---- views ----

function methods.reshape(t, ...)
  local dims = parse_shape("reshape", ...)
  local n = #dims
  if C.fsdp_reshape(out, t, n, int64s(dims, n)) ~= 0 then raise() end
  return wrap()
end
methods.view = methods.reshape

function methods.permute(t, ...)
  local perm = parse_shape("permute", ...)
  local n = #perm
  local p = ffi.new("int[?]", n > 0 and n or 1)
  for i = 1, n do p[i - 1] = cdim(t, perm[i], "permute") end
  if C.fsdp_permute(out, t, n, p) ~= 0 then raise() end
  return wrap()
end

function methods.transpose(t, a, b)
  if C.fsdp_transpose(out, t, cdim(t, a or 1, "transpose"), cdim(t, b or 2, "transpose")) ~= 0 then raise() end
  return wrap()
end
methods.t = methods.transpose

--- t:narrow(dim, start, length): start is 1-based.
function methods.narrow(t, d, start, length)
  if type(start) ~= "number" or type(length) ~= "number" then
    raise("narrow: start and length must be numbers")
  end
  local cd = cdim(t, d, "narrow")
  if C.fsdp_tensor_shape(t, dims8) ~= 0 then raise() end
  local size = tonumber(dims8[cd])
  if start < 1 or length < 0 or start + length - 1 > size then
    raise(fmt("narrow(%s): start %s, length %s does not fit in dim %s of size %d (start is 1-based)",
              describe(t), tostring(start), tostring(length), tostring(d), size))
  end
  if C.fsdp_narrow(out, t, cd, start - 1, length) ~= 0 then raise() end
  return wrap()
end

--- t:select(dim, i): the slice at index i of dim, that dim removed (a view).
function methods.select(t, d, i)
  local dims = shape_of(t)
  local cd = cdim(t, d, "select")
  local size = dims[cd + 1]
  if type(i) ~= "number" then raise("select: index must be a number, got " .. type(i)) end
  if i < 0 then i = size + i + 1 end
  if i < 1 or i > size then
    raise(fmt("select(%s): index %d out of range for dim %s of size %d", describe(t), i, tostring(d), size))
  end
  if C.fsdp_narrow(out, t, cd, i - 1, 1) ~= 0 then raise() end
  local v = wrap()
  table.remove(dims, cd + 1)
  local n = #dims
  if C.fsdp_reshape(out, v, n, int64s(dims, n)) ~= 0 then raise() end
  return wrap()
end

function methods.expand(t, ...)
  local dims = parse_shape("expand", ...)
  local n = #dims
  if C.fsdp_expand(out, t, n, int64s(dims, n)) ~= 0 then raise() end
  return wrap()
end

function methods.contiguous(t)
  if C.fsdp_contiguous(out, t) ~= 0 then raise() end
  return wrap()
end

function methods.detach(t)
  if C.fsdp_detach(out, t) ~= 0 then raise() end
  return wrap()
end

-- ---- in place (never recorded) ----

function methods.fill(t, v)
  if type(v) ~= "number" then raise("fill: value must be a number, got " .. type(v)) end
  if C.fsdp_fill(t, v) ~= 0 then raise() end
  return t
end

--- t:copy(src): t <- src (a tensor broadcast to t's shape, or a number).
function methods.copy(t, src)
  if type(src) == "number" then return methods.fill(t, src) end
  if C.fsdp_copy(t, T(src, "copy")) ~= 0 then raise() end
  return t
end

--- t:clone(): a fresh contiguous copy on t's device, not recorded on the tape.
function methods.clone(t, opts)
  local c = new_tensor(false, shape_of(t),
                       { dtype = dtype_of(t), tag = opts and opts.tag, device = device_id_of(t) })
  if C.fsdp_copy(c, t) ~= 0 then raise() end
  return c
end

function methods.uniform_(t, low, high, seed, stream, offset)
  if C.fsdp_init_uniform(t, low or 0, high or 1, seed or 0, stream or 0, offset or 0) ~= 0 then raise() end
  return t
end

function methods.normal_(t, mean, std, seed, stream, offset)
  if C.fsdp_init_normal(t, mean or 0, std or 1, seed or 0, stream or 0, offset or 0) ~= 0 then raise() end
  return t
end

--- t:to(device): a copy on device ("cpu" or "cuda"): contiguous, its own
-- storage even on the same device, not recorded on the tape.
function methods.to(t, device)
  if device == nil then raise("to(" .. describe(t) .. "): expected a device (\"cpu\" or \"cuda\")") end
  if C.fsdp_tensor_to_device(out, t, device_id(device)) ~= 0 then raise() end
  return wrap()
end
function methods.cuda(t) return methods.to(t, "cuda") end
function methods.cpu(t) return methods.to(t, "cpu") end

--- t:free(): gives the reference back now, instead of at garbage collection.
function methods.free(t)
  if freed[t] then return end
  ffi.gc(t, nil)
  freed[t] = true
  C.fsdp_tensor_release(t)
end

-- ---- ops ----

local function unary(name)
  return function(x)
    if C[name](out, x) ~= 0 then raise() end
    return wrap()
  end
end
methods.gelu = unary("fsdp_gelu")
methods.silu = unary("fsdp_silu")
methods.softmax = unary("fsdp_softmax")
methods.log_softmax = unary("fsdp_log_softmax")

local function scale(x, s)
  if C.fsdp_scale(out, x, s) ~= 0 then raise() end
  return wrap()
end

local function add_scalar(x, s)
  if C.fsdp_add_scalar(out, x, s) ~= 0 then raise() end
  return wrap()
end
methods.scale = scale
methods.add_scalar = add_scalar

function methods.cast(t, dt)
  if C.fsdp_cast(out, t, dtype_id(dt)) ~= 0 then raise() end
  return wrap()
end
function methods.float(t) return methods.cast(t, 0) end
function methods.bf16(t) return methods.cast(t, 1) end

-- dims: nil (all), a number or a list; keepdim: boolean.
local function reduce(name, t, dims, keepdim)
  local n, arr = 0, nil
  if type(dims) == "number" then dims = { dims } end
  if dims then
    n = #dims
    arr = ffi.new("int[?]", n > 0 and n or 1)
    local nd = ndim(t)
    for i = 1, n do arr[i - 1] = cdim(t, dims[i], name, nd) end
  end
  if C[name](out, t, n, arr, keepdim and 1 or 0) ~= 0 then raise() end
  return wrap()
end
function methods.sum(t, dims, keepdim) return reduce("fsdp_sum", t, dims, keepdim) end
function methods.mean(t, dims, keepdim) return reduce("fsdp_mean", t, dims, keepdim) end

--- a:matmul(b, {ta=, tb=}): transposes a and/or b (their last two dims).
function methods.matmul(a, b, opts)
  local ta = opts and (opts.ta or opts.trans_a) and 1 or 0
  local tb = opts and (opts.tb or opts.trans_b) and 1 or 0
  if C.fsdp_matmul(out, a, T(b, "matmul"), ta, tb) ~= 0 then raise() end
  return wrap()
end

function methods.layernorm(x, w, b, eps)
  if C.fsdp_layernorm(out, x, w and T(w, "layernorm weight"), b and T(b, "layernorm bias"), eps or 1e-5) ~= 0 then
    raise()
  end
  return wrap()
end

function methods.rmsnorm(x, w, eps)
  if C.fsdp_rmsnorm(out, x, w and T(w, "rmsnorm weight"), eps or 1e-6) ~= 0 then raise() end
  return wrap()
end

function methods.dropout(x, p, seed, offset)
  if C.fsdp_dropout(out, x, p or 0.5, seed or 0, offset or 0) ~= 0 then raise() end
  return wrap()
end

-- ---- arithmetic ----

local function binary(name, a, b)
  if C[name](out, T(a), T(b)) ~= 0 then raise() end
  return wrap()
end

-- number op tensor: the number as a tensor of t's shape and dtype.
local function full_like(t, v)
  local f = new_tensor(false, shape_of(t), { dtype = dtype_of(t), tag = "activation", device = device_id_of(t) })
  if C.fsdp_fill(f, v) ~= 0 then raise() end
  return f
end

function mt.__add(a, b)
  if type(b) == "number" then return add_scalar(T(a), b) end
  if type(a) == "number" then return add_scalar(T(b), a) end
  return binary("fsdp_add", a, b)
end

function mt.__sub(a, b)
  if type(b) == "number" then return add_scalar(T(a), -b) end
  if type(a) == "number" then return add_scalar(scale(T(b), -1), a) end
  return binary("fsdp_sub", a, b)
end

function mt.__mul(a, b)
  if type(b) == "number" then return scale(T(a), b) end
  if type(a) == "number" then return scale(T(b), a) end
  return binary("fsdp_mul", a, b)
end

function mt.__div(a, b)
  if type(b) == "number" then return scale(T(a), 1 / b) end
  if type(a) == "number" then return binary("fsdp_div", full_like(T(b), a), b) end
  return binary("fsdp_div", a, b)
end

function mt.__unm(a) return scale(T(a), -1) end

function mt.__len(t) return methods.size(t, 1) end

methods.add = mt.__add
methods.sub = mt.__sub
methods.mul = mt.__mul
methods.div = mt.__div

-- ---- autograd ----

--- t:requires_grad() -> boolean; t:requires_grad(flag) -> t.
function methods.requires_grad(t, flag)
  if flag == nil then
    if C.fsdp_tensor_requires_grad(t, int_box) ~= 0 then raise() end
    return int_box[0] ~= 0
  end
  return set_requires_grad(t, flag)
end

-- The accumulated gradient, or nil. Also the property t.grad; t:grad()
-- works through __call (see below) when there is one.
local function get_grad(t)
  if C.fsdp_tensor_grad(t, out) ~= 0 then raise() end
  return wrap_or_nil()
end
methods.get_grad = get_grad

function methods.set_grad(t, g)
  if C.fsdp_tensor_set_grad(t, g and T(g, "set_grad")) ~= 0 then raise() end
  return t
end

function methods.zero_grad(t)
  if C.fsdp_tensor_set_grad(t, nil) ~= 0 then raise() end
  return t
end

function methods.backward(t, grad)
  autograd.backward(t, grad)
end

-- ---- printing ----

local EDGE, SUMMARIZE_OVER = 3, 1000

-- 0-based indices to show along a dim; false marks the "..." gap.
local function shown(n, summarize)
  local l = {}
  if summarize and n > 2 * EDGE then
    for i = 0, EDGE - 1 do l[#l + 1] = i end
    l[#l + 1] = false
    for i = n - EDGE, n - 1 do l[#l + 1] = i end
  else
    for i = 0, n - 1 do l[i + 1] = i end
  end
  return l
end

local function is_finite(v) return v == v and v ~= math.huge and v ~= -math.huge end

-- One format for all shown values: integers as such, else fixed or
-- scientific with 4 decimals.
local function chooser(values, int_dtype)
  local all_int, maxabs, minabs = true, 0, math.huge
  for i = 1, #values do
    local v = values[i]
    if is_finite(v) then
      local a = abs(v)
      if v ~= floor(v) then all_int = false end
      if a > maxabs then maxabs = a end
      if a > 0 and a < minabs then minabs = a end
    end
  end
  local f
  if int_dtype or (all_int and maxabs < 1e10) then
    f = "%d"
  elseif maxabs >= 1e5 or minabs < 1e-4 then
    f = "%.4e"
  else
    f = "%.4f"
  end
  return function(v)
    if v ~= v then return "nan" end
    if v == math.huge then return "inf" end
    if v == -math.huge then return "-inf" end
    return fmt(f, v)
  end
end

local function format_tensor(t)
  local dims = shape_of(t)
  local nd, n, dt = #dims, numel(t), dtype_of(t)
  local shape_txt = concat(dims, ", ")
  local dev = methods.device(t)
  local footer = fmt("[%s tensor of shape (%s) on %s]", dtype_names[dt], shape_txt, dev)
  if n == 0 then return "[]\n" .. footer end
  local read, strides = element_reader(t)
  if nd == 0 then return chooser({ read(0) }, dt >= 2)(read(0)) .. "\n" .. footer end

  local summarize = n > SUMMARIZE_OVER
  local lists = {}
  for d = 1, nd do lists[d] = shown(dims[d], summarize) end

  -- Blocks: one 2-D (or 1-D) matrix per shown index of the leading dims.
  local blocks, values = {}, {}
  local function row_values(off)
    local row = {}
    local l, s = lists[nd], strides[nd]
    for k = 1, #l do
      if l[k] then
        local v = read(off + l[k] * s)
        row[k] = v
        values[#values + 1] = v
      else
        row[k] = false
      end
    end
    return row
  end
  local function walk(d, off, prefix)
    if d >= nd - 1 then
      local rows = {}
      if nd == 1 then
        rows[1] = row_values(off)
      else
        local l, s = lists[nd - 1], strides[nd - 1]
        for k = 1, #l do rows[k] = l[k] and row_values(off + l[k] * s) or false end
      end
      blocks[#blocks + 1] = { header = prefix, rows = rows }
      return
    end
    local l = lists[d]
    for k = 1, #l do
      if l[k] then
        walk(d + 1, off + l[k] * strides[d], prefix .. (l[k] + 1) .. ",")
      else
        blocks[#blocks + 1] = { header = false }
      end
    end
  end
  walk(1, 0, "")

  local format = chooser(values, dt >= 2)
  local width = 0
  for i = 1, #values do
    local w = #format(values[i])
    if w > width then width = w end
  end
  local function render_row(row)
    local cells = {}
    for k = 1, #row do
      local s = row[k] and format(row[k]) or "..."
      cells[k] = string.rep(" ", width - #s) .. s
    end
    return " " .. concat(cells, "  ")
  end

  local lines = {}
  for b = 1, #blocks do
    local blk = blocks[b]
    if not blk.header and not blk.rows then
      if nd > 2 then lines[#lines + 1] = "" end
      lines[#lines + 1] = "..."
    else
      if nd > 2 then
        if #lines > 0 then lines[#lines + 1] = "" end
        lines[#lines + 1] = "(" .. blk.header .. ".,.) = "
      end
      for r = 1, #blk.rows do
        lines[#lines + 1] = blk.rows[r] and render_row(blk.rows[r]) or " ..."
      end
    end
  end
  lines[#lines + 1] = footer
  return concat(lines, "\n")
end

function mt.__tostring(t)
  if freed[t] then return "[freed tensor]" end
  return format_tensor(t)
end

-- ---- the metatype ----

function mt.__index(t, k)
  local m = methods[k]
  if m ~= nil then
    if freed[t] and k ~= "free" then raise(k .. ": tensor was freed with :free()") end
    return m
  end
  if k == "grad" then
    if freed[t] then raise("grad: tensor was freed with :free()") end
    return get_grad(t)
  end
  return nil
end

function mt.__newindex(t, k, v)
  if k == "grad" then return methods.set_grad(t, v) end
  raise("cannot set field '" .. tostring(k) .. "' of a tensor")
end

-- t:grad() is t.grad(t): the gradient called with its owner returns
-- itself. Any other call is a mistake (w(x) for w:matmul(x), or a tensor
-- where a module was meant) and an error.
function mt.__call(self, owner)
  if istype(tensor_ptr, owner) and not freed[owner] then
    local g = get_grad(owner)
    if g ~= nil and g == self then return self end
  end
  raise("a tensor is not callable (t:grad() or t.grad is the gradient; for a product use matmul)")
end

ffi.metatype("struct fsdp_tensor", mt)

-- ---- module-level ops ----

function M.matmul(a, b, opts) return methods.matmul(T(a, "matmul"), b, opts) end
function M.layernorm(x, w, b, eps) return methods.layernorm(T(x, "layernorm"), w, b, eps) end
function M.rmsnorm(x, w, eps) return methods.rmsnorm(T(x, "rmsnorm"), w, eps) end
function M.dropout(x, p, seed, offset) return methods.dropout(T(x, "dropout"), p, seed, offset) end
function M.gelu(x) return methods.gelu(T(x, "gelu")) end
function M.silu(x) return methods.silu(T(x, "silu")) end
function M.softmax(x) return methods.softmax(T(x, "softmax")) end
function M.log_softmax(x) return methods.log_softmax(T(x, "log_softmax")) end
function M.add(a, b) return mt.__add(a, b) end
function M.sub(a, b) return mt.__sub(a, b) end
function M.mul(a, b) return mt.__mul(a, b) end
function M.div(a, b) return mt.__div(a, b) end

--- fsdp.cross_entropy(logits (N, V), targets (N) integer, {ignore_index=-100, valid_vocab=0})
function M.cross_entropy(logits, targets, opts)
  local ignore = opts and opts.ignore_index or -100
  local valid = opts and opts.valid_vocab or 0
  if C.fsdp_cross_entropy(out, T(logits, "cross_entropy"), T(targets, "cross_entropy targets"), ignore, valid) ~= 0 then
    raise()
  end
  return wrap()
end

--- fsdp.embedding(table (V, C), ids integer (...)) -> (..., C)
function M.embedding(tbl, ids)
  if C.fsdp_embedding(out, T(tbl, "embedding"), T(ids, "embedding ids")) ~= 0 then raise() end
  return wrap()
end

--- fsdp.attention(q, k, v, {causal=true, scale=1/sqrt(D)}), all (B, H, T, D)
function M.attention(q, k, v, opts)
  local causal = not (opts and opts.causal == false)
  if C.fsdp_attention(out, T(q, "attention q"), T(k, "attention k"), T(v, "attention v"),
                      causal and 1 or 0, opts and opts.scale or 0) ~= 0 then
    raise()
  end
  return wrap()
end

--- fsdp.attention_qkv(qkv, n_head, {causal=true, scale=1/sqrt(D)}): qkv (B, T, 3C)
-- packed as q heads, k heads, v heads; returns (B, T, C), heads side by side.
function M.attention_qkv(qkv, n_head, opts)
  local causal = not (opts and opts.causal == false)
  if C.fsdp_attention_qkv(out, T(qkv, "attention_qkv qkv"), n_head, causal and 1 or 0, opts and opts.scale or 0) ~= 0 then
    raise()
  end
  return wrap()
end

return M
