-- fsdp.nn.Module: the base of every layer (Torch7 nn style).
--
-- A module declares its parameters with self:param(name, shape, init)
-- and its children with self:add(name, child), both in order. Declaring
-- allocates nothing: shapes and init rules are known before any memory is
-- touched, so a planner can size a model and a sharded model can give each
-- rank only its slice. :materialize{seed=} then allocates every parameter
-- (tag "param") and fills it from (seed, parameter path, element index), so
-- the same path gets the same values whatever the rank count.
--
-- Parameters stay plain fields (self.weight): forward reads them at call
-- time, which lets a sharded wrapper swap in views of a gathered buffer.

local ffi = require "ffi"
local bit = require "bit"
local fsdp = require "fsdp"

local Module = {}
Module.__index = Module
Module.__name = "Module"

--- Module:extend(name): a subclass; instances come from Class(...), which
-- calls Class.__init(self, ...).
function Module:extend(name)
  local cls = setmetatable({}, { __index = self, __call = function(c, ...) return c.new(c, ...) end })
  cls.__index = cls
  cls.__name = name
  cls.__tostring = self.__tostring
  cls.__call = self.__call
  return cls
end

function Module.new(cls, ...)
  local m = setmetatable({ _param_names = {}, _param_specs = {}, _child_names = {}, training = true }, cls)
  if cls.__init then cls.__init(m, ...) end
  return m
end

setmetatable(Module, { __call = function(c, ...) return c.new(c, ...) end })

-- ---- init rules ----

local init = {}
Module.init = init
--- normal(std, mean): values N(mean, std^2) from (seed, path, index).
function init.normal(std, mean) return { kind = "normal", std = std, mean = mean or 0 } end
function init.uniform(low, high) return { kind = "uniform", low = low, high = high } end
function init.constant(v) return { kind = "constant", value = v } end
function init.zeros() return { kind = "constant", value = 0 } end
function init.ones() return { kind = "constant", value = 1 } end

--- The RNG stream of a parameter: FNV-1a (64-bit) of its dotted path.
function init.stream_of(path)
  local h = ffi.new("uint64_t", 14695981039346656037ULL)
  for i = 1, #path do
    h = bit.bxor(h, path:byte(i)) * 1099511628211ULL
  end
  return h
end

--- Fills t with the values that elements [offset, offset + numel) of the
-- parameter at path get under spec: the whole parameter, or one shard of it.
function init.fill(t, spec, seed, path, offset)
  offset = offset or 0
  if spec.kind == "normal" then
    t:normal_(spec.mean, spec.std, seed, init.stream_of(path), offset)
  elseif spec.kind == "uniform" then
    t:uniform_(spec.low, spec.high, seed, init.stream_of(path), offset)
  elseif spec.kind == "constant" then
    t:fill(spec.value)
  else
    error("init.fill: unknown init kind '" .. tostring(spec.kind) .. "' for " .. path, 2)
  end
  return t
end

-- ---- declaring ----

--- self:param(name, shape, init_spec): declares a parameter.
function Module:param(name, shape, spec)
  if self._param_specs[name] then error(self.__name .. ": parameter '" .. name .. "' declared twice", 2) end
  for i, n in ipairs(shape) do
    if type(n) ~= "number" or n < 1 or n ~= math.floor(n) then
      error(string.format("%s: parameter '%s' has a bad size %s at dim %d", self.__name, name, tostring(n), i), 2)
    end
  end
  self._param_names[#self._param_names + 1] = name
  self._param_specs[name] = { shape = shape, init = spec or init.zeros() }
  return self
end

--- self:add(name, child): declares a child module (also self[name]).
function Module:add(name, child)
  if type(child) ~= "table" or getmetatable(child) == nil or not child._param_names then
    error(self.__name .. ":add('" .. tostring(name) .. "'): not a module", 2)
  end
  if (self[name] ~= nil and self[name] ~= child) or self._param_specs[name] then
    error(self.__name .. ": child name '" .. name .. "' is taken", 2)
  end
  self._child_names[#self._child_names + 1] = name
  self[name] = child
  return child
end

-- ---- walking ----

--- Calls fn(module, path) for self and every descendant, parents first.
function Module:apply(fn, prefix)
  prefix = prefix or ""
  fn(self, prefix)
  for _, name in ipairs(self._child_names) do
    local child = self[name]
    child:apply(fn, prefix == "" and name or prefix .. "." .. name)
  end
  return self
end

--- List of { path=, module=, name=, shape=, init=, tensor= } in declaration order.
-- A module reached by two paths (shared) is listed once, under the first
-- (as PyTorch does), unless with_duplicates.
function Module:named_parameters(with_duplicates)
  local list, seen = {}, {}
  self:apply(function(m, prefix)
    if seen[m] and not with_duplicates then return end
    seen[m] = true
    for _, name in ipairs(m._param_names) do
      local spec = m._param_specs[name]
      list[#list + 1] = {
        path = prefix == "" and name or prefix .. "." .. name,
        module = m, name = name, shape = spec.shape, init = spec.init, tensor = m[name],
      }
    end
  end)
  return list
end

function Module:parameters()
  local ps = {}
  for _, p in ipairs(self:named_parameters()) do
    if not p.tensor then error(self.__name .. ":parameters(): '" .. p.path .. "' is not materialized", 2) end
    ps[#ps + 1] = p.tensor
  end
  return ps
end

function Module:num_parameters()
  local n = 0
  for _, p in ipairs(self:named_parameters()) do
    local k = 1
    for _, s in ipairs(p.shape) do k = k * s end
    n = n + k
  end
  return n
end

--- {path = tensor} of every materialized parameter.
function Module:state_dict()
  local sd = {}
  for _, p in ipairs(self:named_parameters()) do sd[p.path] = p.tensor end
  return sd
end

local function m_frozen(p) return p.module._param_specs[p.name].frozen == true end

--- Allocates and initializes every parameter not yet present.
-- opts: seed (default 0), dtype ("f32").
function Module:materialize(opts)
  local seed = opts and opts.seed or 0
  local dtype = opts and opts.dtype or "f32"
  for _, p in ipairs(self:named_parameters()) do
    if not p.tensor then
      local t = fsdp.empty(p.shape, { dtype = dtype, tag = "param" })
      init.fill(t, p.init, seed, p.path, 0)
      t:requires_grad(not m_frozen(p))
      p.module[p.name] = t
    end
  end
  return self
end

local float_dtypes = { f32 = true, bf16 = true }

--- Loads {path = tensor} (copying values); unknown or missing names and
-- shape mismatches are errors unless opts.strict == false; so are integer
-- tensors for float parameters, always.
function Module:load_state_dict(sd, opts)
  local strict = not (opts and opts.strict == false)
  local seen = {}
  for _, p in ipairs(self:named_parameters()) do
    local src = sd[p.path]
    if src == nil then
      if strict then error("load_state_dict: missing '" .. p.path .. "'", 2) end
    else
      if not fsdp.is_tensor(src) then
        error(string.format("load_state_dict: '%s' is a %s, not a tensor", p.path, type(src)), 2)
      end
      local want = p.tensor and p.tensor:dtype() or "f32"
      if not float_dtypes[src:dtype()] and float_dtypes[want] then
        error(string.format("load_state_dict: '%s' is %s, the model's parameter is %s (integer values are not "
          .. "weights)", p.path, src:describe(), want), 2)
      end
      local s = src:shape()
      local same = #s == #p.shape
      for i = 1, #s do same = same and s[i] == p.shape[i] end
      if not same then
        error(string.format("load_state_dict: '%s' has shape (%s), the model expects (%s)", p.path,
          table.concat(s, ", "), table.concat(p.shape, ", ")), 2)
      end
      if not p.tensor then
        local t = fsdp.empty(p.shape, { dtype = "f32", tag = "param" })
        t:requires_grad(not m_frozen(p))
        p.module[p.name] = t
        p.tensor = t
      end
      fsdp.no_grad(function() p.tensor:copy(src) end)
      seen[p.path] = true
    end
  end
  if strict then
    for k in pairs(sd) do
      if not seen[k] then error("load_state_dict: unexpected '" .. k .. "'", 2) end
    end
  end
  return self
end

--- module:requires_grad(false) freezes every parameter of the module and
-- its descendants (true unfreezes them): declared ones (before
-- materialize), materialized ones, and a sharded model's views. A frozen
-- parameter gets no gradient, so optimizers leave it alone; fsdp.shard
-- gives it no gradient shard, no gradient traffic and no optimizer state
-- (freeze before making the optimizer). t:requires_grad(false) on one
-- parameter does the same for that one.
function Module:requires_grad(flag)
  if type(flag) ~= "boolean" then
    error(self.__name .. ":requires_grad: expected true or false, got " .. tostring(flag), 2)
  end
  self:apply(function(m)
    for _, name in ipairs(m._param_names) do
      m._param_specs[name].frozen = not flag
      local t = m[name]
      if fsdp.is_tensor(t) then t:requires_grad(flag) end
    end
  end)
  return self
end

function Module:zero_grad()
  for _, t in ipairs(self:parameters()) do t:zero_grad() end
end

function Module:train(on)
  on = on ~= false
  self:apply(function(m) m.training = on end)
  return self
end

function Module:eval() return self:train(false) end

function Module:forward()
  error(self.__name .. ": forward is not defined", 2)
end

-- A module marked by nn.recompute needs no wrapper: calls go through here,
-- so its paths, and so its parameter names, stay the same.
function Module.__call(self, ...)
  if self._recompute then return require("fsdp.nn.recompute").run(self, ...) end
  return self:forward(...)
end

function Module.__tostring(self)
  local lines = {}
  local function show(m, name, indent)
    local s = string.rep("  ", indent) .. (name and name .. ": " or "") .. m.__name
    local shapes = {}
    for _, pn in ipairs(m._param_names) do
      shapes[#shapes + 1] = pn .. "(" .. table.concat(m._param_specs[pn].shape, "x") .. ")"
    end
    if #shapes > 0 then s = s .. " [" .. table.concat(shapes, ", ") .. "]" end
    lines[#lines + 1] = s
    for _, cn in ipairs(m._child_names) do show(m[cn], cn, indent + 1) end
  end
  show(self, nil, 0)
  return table.concat(lines, "\n")
end

return Module
