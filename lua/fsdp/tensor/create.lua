-- fsdp.tensor.create: the constructors (fsdp.empty, zeros, ones, full,
-- randn, rand, tensor, arange), the default device, and the seed of
-- random init. fsdp.tensor gathers them; use them as fsdp.zeros etc.

local ffi = require "ffi"
local core = require "fsdp.core"
local q = require "fsdp.tensor.query"

local C = core.C
local raise, wrap, out, freed = core.raise, core.wrap, core.out, core.freed
local istype, tensor_ptr = ffi.istype, core.tensor_ptr
local dtype_id, tag_id, device_id = core.dtype_id, core.tag_id, core.device_id
local type, fmt, concat = type, string.format, table.concat
local int64s, parse_shape, elem_array_t, elem_size = q.int64s, q.parse_shape, q.elem_array_t, q.elem_size

local int_box = ffi.new("int[1]")

local M = {}            -- the public constructors
local internal = {}     -- for the other parts of fsdp.tensor

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

--- fsdp.randint(low, high, sizes..., {seed=, stream=, offset=, device=}): whole
-- numbers drawn uniformly from [low, high), i64 (torch.randint), from the same
-- counter-based stream as fsdp.rand; high - low at most 2^24.
function M.randint(low, high, ...)
  if type(low) ~= "number" or type(high) ~= "number" or low ~= math.floor(low) or high ~= math.floor(high)
      or high <= low then
    raise(fmt("fsdp.randint: low and high must be whole numbers with low < high, got %s and %s", tostring(low),
      tostring(high)))
  end
  local span = high - low
  if span > 2 ^ 24 then
    raise(fmt("fsdp.randint: high - low is %.0f, at most 2^24 = 16777216 (each value comes from an f32 draw)", span))
  end
  local dims, opts = parse_shape("fsdp.randint", ...)
  if opts and opts.dtype ~= nil and dtype_id(opts.dtype) ~= 3 then
    raise("fsdp.randint: the values are i64; dtype '" .. tostring(opts.dtype) .. "' is not")
  end
  local u = M.rand(dims, { seed = opts and opts.seed, stream = opts and opts.stream, offset = opts and opts.offset,
    device = "cpu" })
  local n = 1
  for _, d in ipairs(dims) do n = n * d end
  local flat = n > 0 and u:contiguous():view(-1):tolist() or {}
  for i = 1, n do flat[i] = math.min(low + math.floor(flat[i] * span), high - 1) end
  return from_flat(flat, n, dims, { dtype = "i64", device = opts and opts.device, tag = opts and opts.tag })
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

internal.new_tensor, internal.set_requires_grad = new_tensor, set_requires_grad
return { public = M, internal = internal }
