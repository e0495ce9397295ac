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

-- The parts: tensor/query (what a tensor is, its values as Lua numbers),
-- tensor/create (the constructors), tensor/format (printing); this file is
-- the Tensor type itself: its methods, operators and the module-level ops.

local ffi = require "ffi"
local core = require "fsdp.core"
local options = require "fsdp.options"
local autograd = require "fsdp.autograd"
local q = require "fsdp.tensor.query"
local create = require "fsdp.tensor.create"
local format_tensor = require("fsdp.tensor.format").format_tensor

local C = core.C
local raise, wrap, wrap_or_nil, T = core.raise, core.wrap, core.wrap_or_nil, core.T
local out = core.out
local freed = core.freed
local istype, tensor_ptr = ffi.istype, core.tensor_ptr
local dtype_names, dtype_id, device_id = core.dtype_names, core.dtype_id, core.device_id
local tonumber, type, select = tonumber, type, select
local fmt = string.format
local int64s, parse_shape, ndim, describe, cdim = q.int64s, q.parse_shape, q.ndim, q.describe, q.cdim
local dtype_of, numel, shape_of, strides_of, device_id_of = q.dtype_of, q.numel, q.shape_of, q.strides_of,
  q.device_id_of
local to_flat, element_reader = q.to_flat, q.element_reader
local new_tensor, set_requires_grad = create.internal.new_tensor, create.internal.set_requires_grad

local int_box = ffi.new("int[1]")
local dbl_box = ffi.new("double[1]")
local ptr_box = ffi.new("void *[1]")
local dims8 = ffi.new("int64_t[8]")

local M = {}            -- module functions (fsdp.zeros, ...)
local methods = {}      -- tensor methods
local mt = {}           -- the metatable
M.methods = methods
for k, v in pairs(create.public) do M[k] = v end

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

--- t:data_ptr(): the host address of t's first element, to write through
-- (whatever was derived from t's values, a master's compute copy, is stale).
function methods.data_ptr(t)
  if C.fsdp_tensor_data_ptr(t, ptr_box) ~= 0 then raise() end
  return ptr_box[0]
end
--- t:read_ptr(): the same address as a const pointer, for reading only.
local cptr_box = ffi.new("const void *[1]")
function methods.read_ptr(t)
  if C.fsdp_tensor_read_ptr(t, cptr_box) ~= 0 then raise() end
  return cptr_box[0]
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
methods.relu = unary("fsdp_relu")
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
function M.relu(x) return methods.relu(T(x, "relu")) end
--- fsdp.mse_loss(pred, target): mean((pred - target)^2) over every element (PyTorch's default reduction)
function M.mse_loss(pred, target)
  local d = T(pred, "mse_loss") - T(target, "mse_loss target")
  return (d * d):mean()
end
function M.softmax(x) return methods.softmax(T(x, "softmax")) end
function M.log_softmax(x) return methods.log_softmax(T(x, "log_softmax")) end
--- fsdp.bias_gelu(x (..., C), bias (C)): gelu(x + bias) in one pass (a Linear's bias and the GELU after it)
function M.bias_gelu(x, b)
  if C.fsdp_bias_gelu(out, T(x, "bias_gelu"), T(b, "bias_gelu bias")) ~= 0 then raise() end
  return wrap()
end
--- fsdp.bias_residual(x (..., C), bias (C), res (..., C)): res + (x + bias) in one pass (a projection's bias and
-- the residual add after it)
function M.bias_residual(x, b, res)
  if C.fsdp_bias_residual(out, T(x, "bias_residual"), T(b, "bias_residual bias"), T(res, "bias_residual res")) ~= 0
  then
    raise()
  end
  return wrap()
end
--- fsdp.linear(x (..., in), weight (out, in), bias (out) or nil, {gelu = true | residual = r}):
-- [r +] act(x W^T + b) as one op (one GEMM with its epilogue where the device has them); r of the output's shape
local linear_options, mlp_options = { "gelu", "residual" }, { "residual" }
local function op_options(opts, names, what)
  if opts == nil then return {} end
  if type(opts) ~= "table" then error(what .. ": options must be a table, got " .. type(opts), 3) end
  options.check_keys(opts, names, what, 3)
  return opts
end
function M.linear(x, w, b, opts)
  opts = op_options(opts, linear_options, "fsdp.linear")
  local gelu, res = opts.gelu, opts.residual
  if C.fsdp_linear(out, T(x, "linear"), T(w, "linear weight"), b and T(b, "linear bias"),
                   res and T(res, "linear residual"), gelu and C.FSDP_LINEAR_GELU or C.FSDP_LINEAR_NONE) ~= 0 then
    raise()
  end
  return wrap()
end
--- fsdp.mlp(x (..., in), w_fc (hidden, in), b_fc, w_proj (out, hidden), b_proj, {residual = r}):
-- [r +] gelu(x W_fc^T + b_fc) W_proj^T + b_proj as one op (biases may be nil)
function M.mlp(x, w1, b1, w2, b2, opts)
  local res = op_options(opts, mlp_options, "fsdp.mlp").residual
  if C.fsdp_mlp(out, T(x, "mlp"), T(w1, "mlp w_fc"), b1 and T(b1, "mlp b_fc"), T(w2, "mlp w_proj"),
                b2 and T(b2, "mlp b_proj"), res and T(res, "mlp residual")) ~= 0 then
    raise()
  end
  return wrap()
end
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
