-- fsdp.optim: optimizers over lists of tensors (whole parameters, or the
-- flat shards of a sharded model: the same code runs on both), gradient
-- clipping by global norm, and learning-rate schedules.
--
-- Each step is one fused C pass per tensor (fsdp_adamw_step /
-- fsdp_sgd_step); state tensors are allocated under the "optimizer" tag.
local fsdp = require "fsdp"
local C = fsdp.C
local raise = fsdp.core.raise

local M = {}

-- Functions called as fn(optimizer) after every optimizer step: a training
-- step ends there (the dry run of fsdp.dryrun counts steps with it).
M.after_step = {}

-- Tensors whose .grad is a fixed buffer (a sharded model's gradient shard
-- slices), mapped to their sharded model: zero_grad asks that model to
-- zero its gradients (shards, and what no_sync kept) instead of dropping them.
M.persistent_grad = setmetatable({}, { __mode = "k" })

-- Parameter groups: a list of tensors, or {{params = {...}, weight_decay = ...}, ...}.
local function make_groups(name, params, defaults)
  -- an empty list is allowed: a rank whose shard holds only padding has no
  -- parameters, and still takes part in the step
  if type(params) ~= "table" then error(name .. ": expected a list of parameters or groups", 3) end
  local groups = {}
  if fsdp.is_tensor(params[1]) then params = { { params = params } } end
  for gi, g in ipairs(params) do
    if type(g) ~= "table" or type(g.params) ~= "table" then
      error(string.format("%s: group %d needs a params list", name, gi), 3)
    end
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
function M.AdamW(params, opts)
  opts = opts or {}
  local betas = opts.betas or { 0.9, 0.999 }
  local self = setmetatable({
    groups = make_groups("AdamW", params, {
      lr = opts.lr or 1e-3, beta1 = betas[1], beta2 = betas[2], eps = opts.eps or 1e-8,
      weight_decay = opts.weight_decay or 0.01,
    }),
    state = {}, step_count = 0,
  }, AdamW)
  return self
end

-- One step: update(group, param, grad, state, first) for every parameter
-- that has a gradient; state is the parameter's table, made on first use.
local function step_each(self, update)
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
  for _, fn in ipairs(M.after_step) do fn(self) end
end

local function adamw_update(g, p, grad, st, first)
  if first then st.exp_avg, st.exp_avg_sq, st.step = state_like(p), state_like(p), 0 end
  st.step = st.step + 1
  return C.fsdp_adamw_step(p, grad, st.exp_avg, st.exp_avg_sq, g.lr, g.beta1, g.beta2, g.eps, g.weight_decay, st.step)
end

function AdamW:step() step_each(self, adamw_update) end

--- SGD(params, {lr=, momentum=0, dampening=0, weight_decay=0, nesterov=false})
local SGD = {}
SGD.__index = SGD
function M.SGD(params, opts)
  opts = opts or {}
  if type(opts.lr) ~= "number" then error("SGD: lr is required (a number)", 2) end
  return setmetatable({
    groups = make_groups("SGD", params, {
      lr = opts.lr, momentum = opts.momentum or 0, dampening = opts.dampening or 0,
      weight_decay = opts.weight_decay or 0, nesterov = opts.nesterov or false,
    }),
    state = {}, step_count = 0,
  }, SGD)
end

local function sgd_update(g, p, grad, st, first)
  if first and g.momentum ~= 0 then st.buf = state_like(p) end
  return C.fsdp_sgd_step(p, grad, st.buf, g.lr, g.momentum, g.dampening, g.weight_decay, g.nesterov and 1 or 0,
    first and 1 or 0)
end

function SGD:step() step_each(self, sgd_update) end

-- Both optimizers share these.
for _, cls in ipairs({ AdamW, SGD }) do
  function cls:zero_grad()
    local owners = {}
    for _, g in ipairs(self.groups) do
      for _, p in ipairs(g.params) do
        local owner = M.persistent_grad[p]
        if owner then
          if not owners[owner] then
            owners[owner] = true
            owner:zero_grad()
          end
        else
          p:set_grad(nil)
        end
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

--- Global L2 norm of the gradients of params (a sum of squares per tensor
-- in double). opts.reduce, when given, combines the local sum of squares
-- across ranks (sharded models pass their all-reduce here).
function M.grad_norm(params, opts)
  local ffi = require "ffi"
  local box, grads = ffi.new("double[1]"), ffi.new("fsdp_tensor *[?]", #params > 0 and #params or 1)
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

--- Scales gradients so their global norm is at most max_norm (as PyTorch's
-- clip_grad_norm_); returns the norm before clipping.
function M.clip_grad_norm(params, max_norm, opts)
  local norm = M.grad_norm(params, opts)
  local coef = max_norm / (norm + 1e-6)
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
