-- fsdp.checkpoint.common: what a checkpoint is taken of and how ranks
-- agree about it. describe(model) says what this rank holds (the slices of
-- every parameter, in model order, for a sharded model or an nn module);
-- optim_kind names an optimizer's state tensors; together() runs a step on
-- every rank and raises the same error everywhere when any rank failed, so
-- that all ranks leave a collective call the same way. progress() is where
-- save, load, export and import report how far they are.
local ffi = require "ffi"
local fsdp = require "fsdp"

local core = require "fsdp.core"
local C = core.C
local raise = core.raise
local fmt, concat = string.format, table.concat
local floor, min, max = math.floor, math.min, math.max

local M = {}

function M.is_uint(v) return type(v) == "number" and v >= 0 and v == floor(v) and v < 2 ^ 53 end

-- ---- communication: agreement, strings ----

local MAX_OP = 2
local int2 = ffi.new("int[2]")
local comm_box = ffi.new("fsdp_comm *[1]")

local function comm_info(c)
  if C.fsdp_comm_info(c, int2, int2 + 1) ~= 0 then raise() end
  return int2[0], int2[1]
end

-- (every caller asks for the maximum, MAX_OP)
local function allreduce1(comm, v)
  return require("fsdp.distributed")._borrow(comm):max(v)
end

local function world_comm()
  if C.fsdp_comm_world(comm_box) ~= 0 then raise() end
  return ffi.gc(comm_box[0], C.fsdp_comm_free)
end

-- root's string s, on every rank of comm.
local function broadcast_string(comm, root, s)
  local rank = comm_info(comm)
  local n = allreduce1(comm, rank == root and #s or 0, MAX_OP)
  local t = fsdp.zeros({ floor((n + 3) / 4) + 1 }, { dtype = "i32", device = "cpu" })
  if rank == root then ffi.copy(t:data_ptr(), s, #s) end
  if C.fsdp_broadcast(nil, comm, t, root, "checkpoint.message") ~= 0 then raise() end
  return ffi.string(t:data_ptr(), n)
end

-- Every rank's string s, on rank 0 (a list by rank); nil elsewhere.
local function gather_strings(comm, s)
  local rank, size = comm_info(comm)
  if size == 1 then return { s } end
  local n = allreduce1(comm, #s, MAX_OP)
  local words = floor((n + 3) / 4) + 1
  local src = fsdp.zeros({ words }, { dtype = "i32", device = "cpu" })
  local p = ffi.cast("int32_t *", src:data_ptr())
  p[0] = #s
  ffi.copy(p + 1, s, #s)
  local dst = fsdp.empty({ words * size }, { dtype = "i32", device = "cpu" })
  if C.fsdp_all_gather(nil, comm, dst, src, "checkpoint.meta") ~= 0 then raise() end
  if rank ~= 0 then return nil end
  local q = ffi.cast("int32_t *", dst:data_ptr())
  local list = {}
  for r = 0, size - 1 do
    local base = q + r * words
    list[r + 1] = ffi.string(base + 1, base[0])
  end
  return list
end

-- Collective: if any rank failed (ok false), every rank raises the error of
-- the lowest failing rank, so all ranks leave the call the same way.
local function agree(comm, ok, err)
  if comm == nil then
    if not ok then raise(tostring(err)) end
    return
  end
  local rank, size = comm_info(comm)
  local worst = allreduce1(comm, ok and 0 or (size - rank), MAX_OP)
  if worst == 0 then return end
  local root = size - worst
  raise(broadcast_string(comm, root, ok and "" or tostring(err)))
end

-- Runs fn in protected mode, then agrees across ranks on the outcome.
local function together(comm, fn, ...)
  local res = { pcall(fn, ...) }
  agree(comm, res[1], res[2])
  return unpack(res, 2)
end

-- ---- what is saved: a description of a model on this rank ----

local function numel_of(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

local function shape_str(s) return "(" .. concat(s, ", ") .. ")" end

local function is_sharded(x)
  return type(x) == "table" and x.units ~= nil and x.sched ~= nil and x.segments ~= nil
end

local function is_module(x)
  return type(x) == "table" and x._param_names ~= nil and type(x.named_parameters) == "function"
end

local function check_f32(t, what)
  if t:dtype() ~= "f32" or not t:is_contiguous() then
    error(fmt("%s: %s is %s; checkpoints hold contiguous f32 tensors", what, "tensor", t:describe()), 0)
  end
end

-- t's values in host memory, for files: t itself on the CPU, else a copy
-- (a GPU tensor is staged one shard slice at a time).
local function on_host(t)
  if t:device() == "cpu" then return t end
  return t:cpu()
end

-- { kind, model, comm, rank, params = { {path, shape, numel} } (model order),
--   segments = { {path, start, count, flat, key} }, writer, file_id, nfiles,
--   strategy, group_size, units }
local function describe(target, what)
  local d = { params = {}, segments = {} }
  if is_sharded(target) then
    d.kind, d.sharded, d.model = "sharded", target, target.model
    d.comm = target.world
    d.rank = comm_info(target.world)
    d.world = select(2, comm_info(target.world))
    local srank, ssize = comm_info(target.shard_comm)
    d.file_id, d.nfiles = srank, ssize
    -- replicas hold equal shards: only the first replica group writes
    d.writer = target.replica_comm == nil or (comm_info(target.replica_comm)) == 0
    d.strategy = target.strategy
    d.group_size = target.strategy == "hybrid_shard" and ssize or nil
    local k = 0
    for _, u in ipairs(target.units) do
      local lo, hi = u.shard_offset, u.shard_offset + u.shard_numel
      for i, p in ipairs(u.params) do
        local off = u.offsets[i]
        local a, b = max(lo, off), min(hi, off + p.numel)
        if a < b then
          k = k + 1
          local s = target.segments[k]
          if not s or s.path ~= p.path then
            error(what .. ": the sharded model's segments do not follow its units (at " .. p.path .. ")", 0)
          end
          d.segments[#d.segments + 1] = { path = p.path, start = a - off, count = b - a, flat = s.tensor,
            key = s.tensor }
        end
      end
    end
  elseif is_module(target) then
    if rawget(target, "forward") ~= nil then
      -- fsdp.shard wraps the root's forward; its fields are views of gathered buffers
      error(what .. ": this module has been sharded; pass the object fsdp.shard returned", 0)
    end
    d.kind, d.model = "module", target
    d.comm = world_comm()
    d.rank, d.world = comm_info(d.comm)
    d.writer, d.file_id, d.nfiles = d.rank == 0, 0, 1
    d.strategy = "none"
    for _, p in ipairs(target:named_parameters()) do
      local t = p.tensor
      if not t then
        error(fmt("%s: parameter '%s' is not materialized (call model:materialize{} or pass the sharded model)",
          what, p.path), 0)
      end
      if t:dtype() ~= "f32" or not t:is_contiguous() then
        error(fmt("%s: parameter '%s' is %s; checkpoints hold contiguous f32 tensors", what, p.path,
          t:describe()), 0)
      end
      local flat = fsdp.no_grad(function() return t:detach():view(-1) end)
      d.segments[#d.segments + 1] = { path = p.path, start = 0, count = numel_of(p.shape), flat = flat, key = t }
    end
  else
    error(what .. ": model must be a sharded model (fsdp.shard) or an nn module, got " .. type(target), 0)
  end
  for _, p in ipairs(d.model:named_parameters()) do
    d.params[#d.params + 1] = { path = p.path, shape = p.shape, numel = numel_of(p.shape) }
  end
  return d
end

-- Optimizer type and the names of its per-parameter state tensors.
local function optim_kind(opt, what)
  local g = type(opt) == "table" and type(opt.groups) == "table" and opt.groups[1]
  if not g or type(opt.state) ~= "table" then
    error(what .. ": optim must be an fsdp.optim optimizer (AdamW or SGD)", 0)
  end
  if g.beta1 ~= nil then return "AdamW", { "exp_avg", "exp_avg_sq" } end
  if g.momentum ~= nil then return "SGD", { "buf" } end
  error(what .. ": unknown optimizer (expected AdamW or SGD)", 0)
end

local function group_hparams(g)
  local h = {}
  for k, v in pairs(g) do
    local tv = type(v)
    if k ~= "params" and (tv == "number" or tv == "boolean" or tv == "string") then h[k] = v end
  end
  return h
end

local function check_state(state, what)
  if type(state) ~= "table" then error(what .. ": expected a state table {model =, optim =, step =, ...}", 0) end
  if state.model == nil then error(what .. ": state.model is required", 0) end
end
M.check_state = check_state

--- progress(opts, op, total) -> report(done): calls opts.progress(op, done,
-- total) (bytes on this rank; op "save", "load", "export" or "import") when
-- the caller gave one; without one, a bar on rank 0's terminal
-- (fsdp.progress; opts.progress = false: none); else a no-op.
function M.progress(opts, op, total)
  local fn = opts and opts.progress
  if fn == nil and require("fsdp.distributed").rank() == 0 then fn = require("fsdp.progress").reporter() end
  if fn == nil or fn == false then return function() end end
  if type(fn) ~= "function" then error("fsdp.checkpoint." .. op .. ": opts.progress must be a function", 0) end
  return function(done) fn(op, done, total) end
end

M.comm_info = comm_info
M.world_comm = world_comm
M.gather_strings = gather_strings
M.together = together
M.numel_of = numel_of
M.shape_str = shape_str
M.check_f32 = check_f32
M.on_host = on_host
M.describe = describe
M.optim_kind = optim_kind
M.group_hparams = group_hparams

return M
