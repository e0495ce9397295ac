-- fsdp.guard: keeps non-finite training state (NaN or infinity in the
-- loss, the gradient norm or a parameter, on any rank) out of a run.
--
--   local guard = require("fsdp.guard").new { model = sharded, mode = "stop", what = "gpt2.lua", checkpoints = run }
--   local norm = sharded:grad_norm()
--   if guard:check_step { step = step, loss = local_loss, grad_norm = norm } then   -- false: skip this update
--     opt:step { ... }
--     guard:check_params(step)                                                     -- after the update
--   end
--   opt:zero_grad()
--
-- Each check is one collective (a max over three numbers): every rank
-- learns the same verdict, so every rank stops, skips or goes on together.
-- mode "stop" (the default): the first non-finite value ends the run with
-- one line (step, which value, the lowest rank it was seen on), exit status
-- guard.EXIT, before anything is saved from that state. mode "skip": a step
-- whose loss or gradient norm is not finite has its update dropped (the
-- caller skips opt:step), counted and logged; a parameter that an update
-- made non-finite cannot be dropped afterwards, so that stops in both modes.
-- fsdp.checkpoint.save refuses non-finite parameters and optimizer state
-- whatever the loop does.
local ffi = require "ffi"
local core = require "fsdp.core"

local C, raise = core.C, core.raise
local fmt = string.format

local M = {}

M.EXIT = 3              -- exit status of a run stopped on non-finite state
M.MODES = { "stop", "skip" }

-- What was seen, by kind of value (the order of the reduced list).
local LOSS, GRAD, PARAM = 1, 2, 3
local NAMES = { "the loss", "the gradient norm", "a parameter" }
-- How a value is not finite, packed with the rank: (size - rank) * CODES + code,
-- so the max over ranks is the lowest rank that saw it.
local CODES = 4
local CODE_NAMES = { "nan", "inf", "-inf" }

local function code_of(v)
  if v ~= v then return 1 end
  if v == math.huge then return 2 end
  if v == -math.huge then return 3 end
  return 0
end

local sumsq_box = ffi.new("double[1]")

-- The sum of squares of a list of tensors, accumulated in double: finite
-- exactly when every element is (f32 squares cannot overflow a double).
local function sumsq(list)
  local n = #list
  if n == 0 then return 0 end
  local arr = ffi.new("fsdp_tensor *[?]", n)
  for i, t in ipairs(list) do arr[i - 1] = t end
  if C.fsdp_sumsq_many(arr, n, sumsq_box) ~= 0 then raise() end
  return sumsq_box[0]
end
M.sumsq = sumsq

-- The tensors a model holds on this rank, and the group its ranks form.
local function parts_of(model)
  if type(model) == "table" and model.segments and model.group then   -- fsdp.shard's object
    local params = {}
    for _, s in ipairs(model.segments) do params[#params + 1] = s.tensor end
    return params, model.group
  end
  if type(model) == "table" and type(model.named_parameters) == "function" then
    local params = {}
    for _, p in ipairs(model:named_parameters()) do
      if p.tensor then params[#params + 1] = p.tensor end
    end
    return params, require("fsdp.distributed").world_group()
  end
  error("fsdp.guard.new: model must be a sharded model (fsdp.shard) or an nn module", 3)
end

-- The first offending parameter of this rank, for the message.
local function first_bad(model, params)
  local paths = {}
  if model.segments then
    for i, s in ipairs(model.segments) do paths[i] = s.path end
  else
    for i, p in ipairs(model:named_parameters()) do paths[i] = p.path end
  end
  for i, t in ipairs(params) do
    if code_of(sumsq({ t })) ~= 0 then return paths[i] or ("#" .. i) end
  end
  return nil
end

local Guard = {}
Guard.__index = Guard

--- fsdp.guard.new{ model = sharded | module, mode = "stop" | "skip",
--   what = "recipe", log = fn, checkpoints = manager } -> a guard.
-- checkpoints (optional, an fsdp.checkpoint.manager) is named in the stop
-- message (its last save) and refuses to save once the guard has stopped.
function M.new(opts)
  if type(opts) ~= "table" then error("fsdp.guard.new: expected an options table", 2) end
  local mode = opts.mode or "stop"
  if mode ~= "stop" and mode ~= "skip" then
    error("fsdp.guard.new: mode must be 'stop' or 'skip', got " .. tostring(mode), 2)
  end
  local params, group = parts_of(opts.model)
  return setmetatable({ model = opts.model, params = params, group = group, mode = mode,
    what = opts.what or "fsdp.guard", log = opts.log or require("fsdp.distributed").print0,
    checkpoints = opts.checkpoints, skipped = 0, checked_params = false }, Guard)
end

-- One collective: for each kind, the lowest rank whose value is not finite
-- and how; nil when every value everywhere is finite.
function Guard:_agree(codes)
  local size, rank = self.group:size(), self.group:rank()
  local mine = {}
  -- a negative code: not finite here, but only as a sum over ranks (ranked below every rank's own)
  for k = 1, 3 do
    local c = codes[k]
    mine[k] = c > 0 and ((size - rank) * CODES + c) or c < 0 and -c or 0
  end
  local all = self.group:max(mine)
  local seen
  for k = 1, 3 do
    if all[k] > 0 then
      seen = seen or {}
      local r = size - math.floor(all[k] / CODES)
      seen[k] = { rank = r < size and r or nil, how = CODE_NAMES[all[k] % CODES] }
    end
  end
  return seen
end

-- "the loss is nan on rank 1, the gradient norm is nan on rank 0"
local function describe(seen, bad_param)
  local l = {}
  for k = 1, 3 do
    local s = seen[k]
    if s then
      local name = NAMES[k]
      if k == PARAM then name = bad_param and ("parameter '" .. bad_param .. "'") or name end
      l[#l + 1] = fmt("%s is %s %s", name, s.how, s.rank and ("on rank " .. s.rank) or "(a sum over ranks)")
    end
  end
  return table.concat(l, ", ")
end

function Guard:_stop(step, seen, when)
  -- the rank that saw a bad parameter names it; everyone needs the name
  local bad = nil
  if seen[PARAM] then
    local name = self.group:rank() == seen[PARAM].rank and first_bad(self.model, self.params) or ""
    bad = self.group:broadcast(name, seen[PARAM].rank)
    if bad == "" then bad = nil end
  end
  self.stopped = step
  local last = self.checkpoints and self.checkpoints.last_saved
  require("fsdp.options").stop(M.EXIT, "%s: step %d: %s%s: training stopped, nothing saved from this state "
    .. "(%s)%s", self.what, step, describe(seen, bad), when or "",
    last and ("the last checkpoint is " .. last) or "no checkpoint was written in this run",
    self.mode == "stop" and seen[PARAM] == nil and "; --nan=skip drops such steps instead" or "")
end

--- guard:check_step{ step = N, loss = this rank's loss (a number),
-- grad_norm = the global norm } -> true: apply the update; false (mode
-- "skip"): drop it. Collective. The first call also checks the parameters
-- (a bad --init or checkpoint), as check_params does after each update.
function Guard:check_step(s)
  if type(s) ~= "table" or type(s.step) ~= "number" then
    error("fsdp.guard:check_step: expected { step = N, loss = x, grad_norm = x }", 2)
  end
  local codes = { [LOSS] = s.loss ~= nil and code_of(s.loss) or 0,
    [GRAD] = s.grad_norm ~= nil and code_of(s.grad_norm) or 0, [PARAM] = 0 }
  -- the norm is global: the ranks whose own shard is not finite are the ones to name
  local mine = self.model.local_grad_sumsq
  if codes[GRAD] > 0 and type(mine) == "number" and code_of(mine) == 0 then codes[GRAD] = -codes[GRAD] end
  if not self.checked_params then codes[PARAM] = code_of(sumsq(self.params)) end
  self.checked_params = true
  local seen = self:_agree(codes)
  if not seen then return true end
  if self.mode == "stop" or seen[PARAM] then
    self:_stop(s.step, seen, seen[PARAM] and " before the step" or nil)
  end
  self.skipped = self.skipped + 1
  self.log("step %5d | skipped (update dropped): %s | %d step(s) skipped so far", s.step, describe(seen),
    self.skipped)
  return false
end

--- guard:check_params(step): after the update; stops the run when it made
-- a parameter non-finite on any rank. Collective.
function Guard:check_params(step)
  local seen = self:_agree({ 0, 0, code_of(sumsq(self.params)) })
  if seen then self:_stop(step, seen, " after the update") end
end

return M
