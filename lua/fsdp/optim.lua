-- fsdp.optim: optimizers over lists of tensors (whole parameters, or the
-- flat shards of a sharded model: the same code runs on both), gradient
-- clipping by global norm, and learning-rate schedules.
--
-- Each step is one fused C pass per tensor (fsdp_sgd_step), or one call
-- for all of them (fsdp_adamw_step_many); state tensors are allocated under the "optimizer" tag.
local fsdp = require "fsdp"
local core = require "fsdp.core"
local options = require "fsdp.options"
local C = core.C
local ffi = require "ffi"
local raise = core.raise

local M = {}

-- Functions called as fn(optimizer) after every optimizer step: a training
-- step ends there (the dry run of fsdp.dryrun counts steps with it).
M.after_step = {}

-- Parameter groups: a list of tensors, or {{params = {...}, weight_decay = ...}, ...}.
-- A group (or a list) may carry zero_grad, a function that zero_grad calls
-- instead of dropping the group's gradients: a sharded model's slices have
-- fixed gradient buffers, which it zeroes itself (with what no_sync kept).
-- Group keys are the optimizer's option names, plus params and zero_grad.
local function make_groups(name, params, defaults, option_names)
  -- an empty list is allowed: a rank whose shard holds only padding has no
  -- parameters, and still takes part in the step
  if type(params) ~= "table" then error(name .. ": expected a list of parameters or groups", 3) end
  local groups = {}
  if fsdp.is_tensor(params[1]) or (params[1] == nil and params.zero_grad) then
    params = { { params = params, zero_grad = params.zero_grad } }
  end
  local group_keys = { "params", "zero_grad" }
  for _, k in ipairs(option_names) do group_keys[#group_keys + 1] = k end
  for gi, g in ipairs(params) do
    if type(g) ~= "table" or type(g.params) ~= "table" then
      error(string.format("%s: group %d needs a params list", name, gi), 3)
    end
    options.check_keys(g, group_keys, string.format("%s: group %d", name, gi), 3)
    local group = {}
    for k, v in pairs(defaults) do group[k] = v end
    for k, v in pairs(g) do group[k] = v end
    for i, p in ipairs(group.params) do
      if not fsdp.is_tensor(p) then error(string.format("%s: group %d entry %d is not a tensor", name, gi, i), 3) end
    end
    groups[gi] = group
  end
  return groups
end

-- beside its parameter: on the CPU for shards offloaded there
local function state_like(p)
  return fsdp.zeros(p:shape(), { dtype = "f32", tag = "optimizer", device = p:device() })
end

--- AdamW(params, {lr=1e-3, betas={0.9, 0.999}, eps=1e-8, weight_decay=0.01})
local AdamW = {}
AdamW.__index = AdamW
local adamw_options = { "lr", "betas", "eps", "weight_decay" }
function M.AdamW(params, opts)
  opts = opts or {}
  options.check_keys(opts, adamw_options, "AdamW", 2)
  local betas = opts.betas or { 0.9, 0.999 }
  local self = setmetatable({
    groups = make_groups("AdamW", params, {
      lr = opts.lr or 1e-3, beta1 = betas[1], beta2 = betas[2], eps = opts.eps or 1e-8,
      weight_decay = opts.weight_decay or 0.01,
    }, { "lr", "beta1", "beta2", "eps", "weight_decay" }),
    state = {}, step_count = 0,
  }, AdamW)
  -- checked now, not at the first step()
  for gi, g in ipairs(self.groups) do
    for _, k in ipairs({ "lr", "beta1", "beta2", "eps", "weight_decay" }) do
      local v = g[k]
      if type(v) ~= "number" or v ~= v or v < 0 or v == math.huge then
        error(string.format("AdamW: group %d: %s must be a finite number >= 0, got %s (%s)", gi,
          k == "beta1" and "betas[1]" or k == "beta2" and "betas[2]" or k, tostring(v), type(v)), 2)
      end
    end
  end
  return self
end

-- step(opts): opts.grad_scale = s reads every gradient as grad * s (a
-- number >= 0, finite; default 1), the clip by global norm without a pass of
-- its own: opt:step { grad_scale = optim.clip_coef(norm, max_norm) } updates
-- the parameters as clip_grad_norm(params, max_norm) and then opt:step()
-- would. AdamW folds it into its one pass and leaves the gradients as they
-- are; SGD scales them in place first.
local step_option_names = { "grad_scale" }
local function step_grad_scale(name, opts)
  if opts == nil then return 1 end
  if type(opts) ~= "table" then error(string.format("%s:step: expected an options table, got %s", name, type(opts)), 3) end
  options.check_keys(opts, step_option_names, name .. ":step", 3)
  local s = opts.grad_scale
  if s == nil then return 1 end
  if type(s) ~= "number" or s ~= s or s < 0 or s == math.huge then
    error(string.format("%s:step: grad_scale must be a finite number >= 0, got %s (%s)", name, tostring(s), type(s)), 3)
  end
  return s
end

-- One step: update(group, param, grad, state, first) for every parameter
-- that has a gradient; state is the parameter's table, made on first use.
-- finish(), when given, runs after the last update (a batched call).
local function step_each(self, update, finish)
  self.step_count = self.step_count + 1
  for _, g in ipairs(self.groups) do
    for _, p in ipairs(g.params) do
      local grad = p:get_grad()
      if grad then
        local st, first = self.state[p], false
        if not st then
          st, first = {}, true
          self.state[p] = st
        end
        if update(g, p, grad, st, first) ~= 0 then raise() end
      end
    end
  end
  if finish then finish() end
  C.fsdp_trace_step(self.step_count)   -- a step boundary on the timeline (when one is recorded)
  for _, fn in ipairs(M.after_step) do fn(self) end
end

-- One fused C call for every parameter with a gradient (per run of
-- parameters with the same betas, eps and device; usually one): a few launches on a GPU instead of one per tensor.
local function new_batch() return { n = 0, params = {}, grads = {}, m = {}, v = {}, lr = {}, wd = {}, step = {} } end

local function adamw_flush(b, g, grad_scale)
  local n = b.n
  if n == 0 then return end
  local function ptrs(list) return ffi.new("fsdp_tensor *[?]", n, list) end
  -- b keeps the tensors referenced while C reads them
  local rc = C.fsdp_adamw_step_many(ptrs(b.params), ptrs(b.grads), ptrs(b.m), ptrs(b.v),
    ffi.new("double[?]", n, b.lr), ffi.new("double[?]", n, b.wd), ffi.new("int64_t[?]", n, b.step), n,
    g.beta1, g.beta2, g.eps, grad_scale)
  -- the gradient references step_each took go back now, not when the
  -- collector runs (zero_grad then frees the gradients themselves)
  for i = 1, n do b.grads[i]:free() end
  if rc ~= 0 then raise() end
end

function AdamW:step(opts)
  local grad_scale = step_grad_scale("AdamW", opts)
  local b, last, last_device = new_batch(), nil, nil
  step_each(self, function(g, p, grad, st, first)
    local device = p:device()   -- one call reads tensors of one device
    if last and (last.beta1 ~= g.beta1 or last.beta2 ~= g.beta2 or last.eps ~= g.eps or device ~= last_device) then
      adamw_flush(b, last, grad_scale)
      b = new_batch()
    end
    last, last_device = g, device
    if first then st.exp_avg, st.exp_avg_sq, st.step = state_like(p), state_like(p), 0 end
    st.step = st.step + 1
    local n = b.n + 1
    b.n, b.params[n], b.grads[n], b.m[n], b.v[n] = n, p, grad, st.exp_avg, st.exp_avg_sq
    b.lr[n], b.wd[n], b.step[n] = g.lr, g.weight_decay, st.step
    return 0
  end, function() if last then adamw_flush(b, last, grad_scale) end end)
end

--- SGD(params, {lr=, momentum=0, dampening=0, weight_decay=0, nesterov=false})
local SGD = {}
SGD.__index = SGD
local sgd_options = { "lr", "momentum", "dampening", "weight_decay", "nesterov" }
function M.SGD(params, opts)
  opts = opts or {}
  options.check_keys(opts, sgd_options, "SGD", 2)
  if type(opts.lr) ~= "number" then error("SGD: lr is required (a number)", 2) end
  return setmetatable({
    groups = make_groups("SGD", params, {
      lr = opts.lr, momentum = opts.momentum or 0, dampening = opts.dampening or 0,
      weight_decay = opts.weight_decay or 0, nesterov = opts.nesterov or false,
    }, sgd_options),
    state = {}, step_count = 0,
  }, SGD)
end

local function sgd_update(g, p, grad, st, first)
  if first and g.momentum ~= 0 then st.buf = state_like(p) end
  return C.fsdp_sgd_step(p, grad, st.buf, g.lr, g.momentum, g.dampening, g.weight_decay, g.nesterov and 1 or 0,
    first and 1 or 0)
end

function SGD:step(opts)
  local grad_scale = step_grad_scale("SGD", opts)
  if grad_scale == 1 then return step_each(self, sgd_update) end
  step_each(self, function(g, p, grad, st, first)
    if C.fsdp_scale_(grad, grad_scale) ~= 0 then return -1 end
    return sgd_update(g, p, grad, st, first)
  end)
end

-- Both optimizers share these.
for _, cls in ipairs({ AdamW, SGD }) do
  function cls:zero_grad()
    local called = {}
    for _, g in ipairs(self.groups) do
      if g.zero_grad then
        if not called[g.zero_grad] then
          called[g.zero_grad] = true
          g.zero_grad()
        end
      else
        for _, p in ipairs(g.params) do p:set_grad(nil) end
      end
    end
  end
  function cls:set_lr(lr)
    for _, g in ipairs(self.groups) do g.lr = lr end
  end
  function cls:params()
    local ps = {}
    for _, g in ipairs(self.groups) do
      for _, p in ipairs(g.params) do ps[#ps + 1] = p end
    end
    return ps
  end
end

--- Parameter groups in the usual split: decay on matrices and embeddings
-- (2+ dims), none on biases and norm weights.
function M.decay_groups(named, weight_decay)
  local decay, no_decay = {}, {}
  for _, p in ipairs(named) do
    local t = p.tensor or p
    if #t:shape() >= 2 then decay[#decay + 1] = t else no_decay[#no_decay + 1] = t end
  end
  local groups = {}
  if #decay > 0 then groups[#groups + 1] = { params = decay, weight_decay = weight_decay } end
  if #no_decay > 0 then groups[#groups + 1] = { params = no_decay, weight_decay = 0 } end
  return groups
end

local sumsq_box = require("ffi").new("double[1]")

--- Global L2 norm of the gradients of params (a sum of squares per tensor
-- in double). opts.reduce, when given, combines the local sum of squares
-- across ranks (sharded models pass their all-reduce here).
function M.grad_norm(params, opts)
  local box, grads = sumsq_box, require("ffi").new("fsdp_tensor *[?]", #params > 0 and #params or 1)
  local keep = {}   -- the gradients stay referenced while C reads them
  for i, p in ipairs(params) do
    keep[i] = p:get_grad() or false
    grads[i - 1] = keep[i] or nil
  end
  if C.fsdp_sumsq_many(grads, #params, box) ~= 0 then raise() end   -- one pass, one wait
  local total = box[0]
  if opts and opts.reduce then total = opts.reduce(total) end
  return math.sqrt(total)
end

--- The factor clip_grad_norm scales the gradients by, given their global
-- norm: max_norm / (norm + 1e-6) where that is below 1, else 1 (as PyTorch's
-- clip_grad_norm_; a NaN norm leaves them as they are). For
-- opt:step { grad_scale = ... }, which applies it in the optimizer's pass.
-- The one place the coefficient is computed: both clip_grad_norm (this
-- module's and Sharded's) call it with their own name for the error, which
-- then points at their caller.
function M.clip_coef(norm, max_norm, caller)
  if type(norm) ~= "number" or type(max_norm) ~= "number" or max_norm ~= max_norm or max_norm < 0 then
    error(string.format("%s: expected a norm and a max_norm >= 0, got %s (%s), %s (%s)", caller or "clip_coef",
      tostring(norm), type(norm), tostring(max_norm), type(max_norm)), caller and 3 or 2)
  end
  local coef = max_norm / (norm + 1e-6)
  return coef < 1 and coef or 1
end

--- Scales gradients so their global norm is at most max_norm (as PyTorch's
-- clip_grad_norm_); returns the norm before clipping.
function M.clip_grad_norm(params, max_norm, opts)
  local norm = M.grad_norm(params, opts)
  local coef = M.clip_coef(norm, max_norm, "clip_grad_norm")
  if coef < 1 then
    for _, p in ipairs(params) do
      local g = p:get_grad()
      if g and C.fsdp_scale_(g, coef) ~= 0 then raise() end
    end
  end
  return norm
end

-- ---- learning-rate schedules: functions of the step (1-based) ----
M.schedule = {}

function M.schedule.constant(lr)
  return function() return lr end
end

--- Linear warmup over `warmup` steps, then cosine decay to min_lr at `total`.
function M.schedule.cosine(lr, warmup, total, min_lr)
  min_lr = min_lr or 0
  return function(step)
    if step <= warmup then return lr * step / math.max(1, warmup) end
    if step >= total then return min_lr end
    local t = (step - warmup) / math.max(1, total - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))
  end
end

--- Linear warmup, then linear decay to min_lr at `total`.
function M.schedule.linear(lr, warmup, total, min_lr)
  min_lr = min_lr or 0
  return function(step)
    if step <= warmup then return lr * step / math.max(1, warmup) end
    if step >= total then return min_lr end
    return lr + (min_lr - lr) * (step - warmup) / math.max(1, total - warmup)
  end
end

return M
