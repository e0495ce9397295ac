-- fsdp.compress: fsdp.shard's compress option (compressed gradient
-- reduction with error feedback, engine/distributed/comm_compress.c) and
-- the residuals it keeps, which are training state (checkpoints save them).
--
--   fsdp.shard(model, { compress = { grads = "int8", block = 256 } })
--   fsdp.shard(model, { compress = { grads = "topk", density = 0.01, error_feedback = true } })
local options = require "fsdp.options"
local core = require "fsdp.core"
local C, raise = core.C, core.raise
local fmt = string.format

local M = {}

M.option_names = { "grads", "block", "density", "error_feedback", "params", "scope" }
M.modes = { none = 0, int8 = 1, topk = 2 }

local function fail(msg, level) error("fsdp.shard: compress." .. msg, level + 1) end

--- The checked settings of opts.compress: { grads, mode, block, density,
-- error_feedback }, or nil when nothing is compressed. level: error level.
function M.parse(c, strategy, offload, level)
  level = (level or 1) + 1
  if c == nil then return nil end
  if type(c) ~= "table" then
    error("fsdp.shard: compress must be a table { grads = \"int8\" | \"topk\", ... }, got " .. type(c), level)
  end
  options.check_keys(c, M.option_names, "fsdp.shard: compress", level)
  local grads = c.grads or "none"
  if M.modes[grads] == nil then
    fail(fmt("grads '%s': unknown mode (expected none, int8 or topk)", tostring(grads)), level)
  end
  if c.params ~= nil and c.params ~= "none" then
    fail(fmt("params '%s': compressed weight gathers are not built yet (expected none)", tostring(c.params)), level)
  end
  if c.scope ~= nil and c.scope ~= "all" then
    fail(fmt("scope '%s': only \"all\" (every reduce-scatter) is built yet", tostring(c.scope)), level)
  end
  local block = c.block or 256
  if type(block) ~= "number" or block < 1 or block ~= math.floor(block) or block > 2 ^ 30 or
      2 ^ math.floor(math.log(block) / math.log(2) + 0.5) ~= block then
    fail(fmt("block %s: expected a positive power of two (e.g. 256)", tostring(block)), level)
  end
  local density = c.density or 0.01
  if type(density) ~= "number" or not (density > 0 and density <= 1) then
    fail(fmt("density %s: expected a number in (0, 1]", tostring(density)), level)
  end
  if c.error_feedback ~= nil and type(c.error_feedback) ~= "boolean" then
    fail("error_feedback must be true or false, got " .. tostring(c.error_feedback), level)
  end
  if grads == "none" then return nil end
  if strategy == "no_shard" then
    fail(fmt("grads '%s' with strategy no_shard: no_shard all-reduces whole gradients in place; compression "
      .. "takes a reduce-scatter (use full_shard, shard_grad_op or hybrid_shard)", grads), level)
  end
  if offload then fail(fmt("grads '%s' with offload: compressed reductions need the shards on the host", grads), level) end
  return { grads = grads, mode = M.modes[grads], block = block, density = density,
    error_feedback = c.error_feedback ~= false }
end

--- Applies settings s (M.parse) to a new schedule; a shard group of one
-- (direct) reduces nothing, so compression is a no-op there.
function M.apply(sched, s, direct)
  if not s or direct then return end
  if C.fsdp_sched_set_compress(sched, s.mode, s.block, s.density, s.error_feedback and 1 or 0) ~= 0 then raise() end
end

--- The residual of schedule unit index (a tensor, nil when none was made).
function M.residual(sharded, index)
  if C.fsdp_unit_residual(sharded.sched, index, core.out) ~= 0 then raise() end
  return core.wrap_or_nil()
end

--- Sets it to values (a tensor of the padded unit's elements), or zeros.
function M.set_residual(sharded, index, values)
  if C.fsdp_unit_set_residual(sharded.sched, index, values) ~= 0 then raise() end
end

--- What a checkpoint records of sharded's compression (nil: none).
function M.describe(sharded)
  local s = sharded.compress
  if not s or sharded.direct then return nil end
  return { grads = s.grads, block = s.block, density = s.density, error_feedback = s.error_feedback }
end

return M
