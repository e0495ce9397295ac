-- fsdp.autograd: the backward loop, grad mode, and ops defined in Lua.
--
-- The tape lives in the engine (DESIGN.md, decision 3). Backward is a loop
-- of fsdp_backward_step calls; the engine pauses at each op recorded by
-- Lua and hands back its id, we run its Lua backward and step again, so the
-- engine never calls back into Lua.

local ffi = require "ffi"
local core = require "fsdp.core"

local C = core.C
local raise, wrap, T = core.raise, core.wrap, core.T
local out = core.out
local istype, tensor_ptr = ffi.istype, core.tensor_ptr
local select, type, unpack = select, type, unpack

local M = {}

local int_box = ffi.new("int[1]")
local dims8 = ffi.new("int64_t[8]")

-- ---- grad mode ----

--- fsdp.set_grad_enabled(on) -> previous (boolean)
function M.set_grad_enabled(on)
  if C.fsdp_set_grad_enabled(on and 1 or 0, int_box) ~= 0 then raise() end
  return int_box[0] ~= 0
end
local set_grad_enabled = M.set_grad_enabled

function M.is_grad_enabled()
  if C.fsdp_grad_enabled(int_box) ~= 0 then raise() end
  return int_box[0] ~= 0
end

local function pack(...) return { n = select("#", ...), ... } end

local function finish_mode(prev, ok, ...)
  set_grad_enabled(prev)
  if not ok then error((...), 0) end
  return ...
end

--- fsdp.no_grad(fn, ...): fn(...) with gradients off; the mode is restored
-- even when fn raises.
function M.no_grad(fn, ...)
  return finish_mode(set_grad_enabled(false), pcall(fn, ...))
end

--- fsdp.enable_grad(fn, ...): fn(...) with gradients on (e.g. recomputing a
-- forward inside a backward, where the engine turns them off).
function M.enable_grad(fn, ...)
  return finish_mode(set_grad_enabled(true), pcall(fn, ...))
end

-- ---- registry of Lua-defined ops on the tape ----
--
-- id -> { fn = Function, ctx = ctx, pos = {arg positions of tensor inputs},
--         n_in =, n_out =, outs = {shape, dtype of each output} }.
-- Ids are reused; each is freed after its backward has run, or when the
-- tape it was recorded on is consumed (backward end or error, clear, pop).

local registry = {}
local free_ids, n_free = {}, 0
local next_id = 0
local live = 0
local depth = 1                -- tape depth, as pushed and popped through us
local at_depth = { {} }        -- depth -> set of live ids recorded there
local WARN_LIVE = 100000
local warned = false

local function alloc_id()
  local id
  if n_free > 0 then
    id = free_ids[n_free]
    free_ids[n_free] = nil
    n_free = n_free - 1
  else
    id = next_id
    next_id = next_id + 1
  end
  live = live + 1
  if live > WARN_LIVE and not warned then
    warned = true
    io.stderr:write("fsdp: ", live, " Lua-defined ops are waiting on the tape; call backward, ",
                    "fsdp.tape_clear(), or run forward passes under fsdp.no_grad\n")
  end
  return id
end

local function free_id(id)
  local rec = registry[id]
  if not rec then return end
  registry[id] = nil
  at_depth[rec.depth][id] = nil
  n_free = n_free + 1
  free_ids[n_free] = id
  live = live - 1
end

local function free_depth(d)
  local set = at_depth[d]
  if not set then return end
  for id in pairs(set) do free_id(id) end
end

function M.live_ops() return live end

function M.tape_size()
  local n = ffi.new("int64_t[1]")
  if C.fsdp_tape_size(n) ~= 0 then raise() end
  return tonumber(n[0])
end

function M.tape_clear()
  if C.fsdp_tape_clear() ~= 0 then raise() end
  free_depth(depth)
end

--- fsdp.tape_push(): a fresh tape for a nested forward and backward.
function M.tape_push()
  if C.fsdp_tape_push() ~= 0 then raise() end
  depth = depth + 1
  at_depth[depth] = {}
end

function M.tape_pop()
  if C.fsdp_tape_pop() ~= 0 then raise() end
  free_depth(depth)
  at_depth[depth] = nil
  depth = depth - 1
end

-- ---- backward ----

local function new_zeros(shape, dt, device)
  local n = #shape
  for i = 1, n do dims8[i - 1] = shape[i] end
  if C.fsdp_tensor_zeros(out, dt, n, dims8, core.device_id(device), 3) ~= 0 then raise() end
  return wrap()
end

-- Runs the Lua backward of op `id`, paused in the engine.
local function run_custom(id)
  local rec = registry[id]
  if not rec then raise("backward: no Lua op registered under id " .. id) end
  local fn = rec.fn
  local gouts = {}
  for i = 1, rec.n_out do
    if C.fsdp_custom_grad_output(i - 1, out) ~= 0 then raise() end
    local g = core.wrap_or_nil()
    if g == nil and fn.materialize_grads ~= false then
      g = new_zeros(rec.outs[i].shape, rec.outs[i].dtype, rec.outs[i].device)
    end
    gouts[i] = g
  end
  -- Gradients come back one per forward argument (nil = none).
  local grads = { fn.backward(rec.ctx, unpack(gouts, 1, rec.n_out)) }
  local pos = rec.pos
  for j = 1, rec.n_in do
    local g = grads[pos[j]]
    if g ~= nil then
      if C.fsdp_custom_add_grad_input(j - 1, T(g, "gradient returned by a Function's backward")) ~= 0 then
        raise()
      end
    end
  end
  free_id(id)
end

--- backward(root, grad): accumulates gradients into the leaves' .grad.
-- grad may be nil when root has one element.
function M.backward(root, grad)
  T(root, "backward")
  local my_depth = depth
  if C.fsdp_backward_begin(root, grad and T(grad, "backward grad")) ~= 0 then raise() end
  local idb = ffi.new("int[1]")   -- not shared: backwards nest (recomputation)
  while true do
    if C.fsdp_backward_step(idb) ~= 0 then   -- the engine has reset the tape
      free_depth(my_depth)
      raise()
    end
    local id = idb[0]
    if id == -1 then break end
    local ok, err = pcall(run_custom, id)
    if not ok then
      -- a Lua backward that failed inside a nested tape leaves it pushed
      while depth > my_depth do pcall(M.tape_pop) end
      C.fsdp_backward_abort()
      free_depth(my_depth)
      error(err, 0)
    end
  end
  free_depth(my_depth)   -- the tape is consumed
  -- the forward's activations are unreachable now: free them before the next step
  if my_depth == 1 then core.collect() end
end

-- ---- Lua-defined ops ----

local Function = {}
Function.__index = Function

local function is_tensor(x) return istype(tensor_ptr, x) end

local function requires_grad(t)
  if C.fsdp_tensor_requires_grad(t, int_box) ~= 0 then raise() end
  return int_box[0] ~= 0
end

local function record(self, ctx, args, nargs, outs, nouts)
  local pos, ins = {}, {}
  for i = 1, nargs do
    local a = args[i]
    if is_tensor(a) then
      pos[#pos + 1] = i
      ins[#ins + 1] = a
    end
  end
  local n_in = #ins
  local out_tensors, shapes = {}, {}
  for i = 1, nouts do
    local o = outs[i]
    if is_tensor(o) then
      out_tensors[#out_tensors + 1] = o
      shapes[#shapes + 1] = { shape = o:shape(), dtype = core.dtype_id(o:dtype()), device = o:device() }
    end
  end
  local n_out = #out_tensors
  if n_out == 0 then raise("Function: forward returned no tensor") end
  local id = alloc_id()
  local in_arr = ffi.new("fsdp_tensor *[?]", n_in > 0 and n_in or 1)
  for i = 1, n_in do in_arr[i - 1] = ins[i] end
  local out_arr = ffi.new("fsdp_tensor *[?]", n_out)
  for i = 1, n_out do out_arr[i - 1] = out_tensors[i] end
  registry[id] = { fn = self, ctx = ctx, pos = pos, n_in = n_in, n_out = n_out, outs = shapes, depth = depth }
  at_depth[depth][id] = true
  if C.fsdp_custom_record(id, n_in, in_arr, n_out, out_arr) ~= 0 then
    free_id(id)
    raise()
  end
end

--- F(...): runs forward(ctx, ...) with gradients off; when gradients are on
-- and a tensor argument requires grad, records the op so that backward
-- calls backward(ctx, grad_out1, ...), which returns one gradient per
-- forward argument (nil for none / non-tensors).
function Function:apply(...)
  local ctx = {}
  local nargs = select("#", ...)
  local args = { ... }
  local was = set_grad_enabled(false)
  local res = pack(pcall(self.forward, ctx, ...))
  set_grad_enabled(was)
  if not res[1] then error(res[2], 0) end
  local nouts = res.n - 1
  local outs = { unpack(res, 2, res.n) }
  if was then
    local any = false
    for i = 1, nargs do
      local a = args[i]
      if is_tensor(a) and requires_grad(a) then any = true; break end
    end
    if any then
      -- An input handed back as is would become the op's output on the
      -- tape (no longer a leaf): give back an alias of it instead.
      for i = 1, nouts do
        for j = 1, nargs do
          if is_tensor(outs[i]) and outs[i] == args[j] then
            if C.fsdp_detach(out, outs[i]) ~= 0 then raise() end
            outs[i] = wrap()
          end
        end
      end
      record(self, ctx, args, nargs, outs, nouts)
    end
  end
  return unpack(outs, 1, nouts)
end

Function.__call = Function.apply

--- fsdp.Function{forward = function(ctx, ...) end, backward = function(ctx, gout...) end,
--                materialize_grads = true}: zero gradients for outputs that got none
-- are passed as zero tensors (nil when materialize_grads is false).
function M.Function(def)
  if type(def) ~= "table" or type(def.forward) ~= "function" or type(def.backward) ~= "function" then
    raise("fsdp.Function: expected a table with forward and backward functions")
  end
  return setmetatable(def, Function)
end

return M
