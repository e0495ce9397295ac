-- fsdp: the Lua front end of the fsdp-lua engine.
--
--   local fsdp = require "fsdp"
--   local x = fsdp.randn(4, 3, {seed = 1, requires_grad = true})
--   local loss = (x * x):sum()
--   loss:backward()
--   print(x.grad)
--
-- Tensors (fsdp.tensor) and autograd (fsdp.autograd) live in their own
-- modules; this one gathers their public functions in one table. The
-- binding itself (fsdp.core) is not part of it: library modules require
-- "fsdp.core", recipes use the Lua API only.

local ffi = require "ffi"
local core = require "fsdp.core"
local tensor = require "fsdp.tensor"
local autograd = require "fsdp.autograd"

local C, raise = core.C, core.raise

local fsdp = {}

for k, v in pairs(tensor) do
  if k ~= "methods" then fsdp[k] = v end
end
fsdp.Tensor = tensor.methods   -- add methods here to extend every tensor

fsdp.backward = autograd.backward
fsdp.shipped = require("fsdp.shipped").path       -- a file shipped with fsdp-lua, from any directory
fsdp.shipped_root = require("fsdp.shipped").root
fsdp.no_grad = autograd.no_grad
fsdp.enable_grad = autograd.enable_grad
fsdp.set_grad_enabled = autograd.set_grad_enabled
fsdp.is_grad_enabled = autograd.is_grad_enabled
fsdp.Function = autograd.Function
fsdp.tape_size = autograd.tape_size
fsdp.tape_clear = autograd.tape_clear
fsdp.tape_push = autograd.tape_push
fsdp.tape_pop = autograd.tape_pop

fsdp.autograd = autograd
fsdp.memory = require "fsdp.memory"
do   -- the vocabulary-chunked head, loss and embedding
  local classifier = require "fsdp.classifier"
  fsdp.chunked_cross_entropy = classifier.chunked_cross_entropy
  fsdp.chunked_embedding = classifier.chunked_embedding
  fsdp.chunked_logits = classifier.chunked_logits
  fsdp.classifier_cross_entropy = classifier.classifier_cross_entropy
end
--- Gives every dead tensor's memory back now. Lua's collector sees only
-- the small handles, so it may otherwise keep the engine memory of
-- finished work (an evaluation's activations) for a while.
fsdp.collect = core.collect
-- Devices: fsdp.default_device() -> "cpu" | "cuda"; fsdp.set_default_device(name).
-- Constructors put tensors there when opts.device is not given.
fsdp.default_device = tensor.default_device
fsdp.set_default_device = tensor.set_default_device

-- Sharding (fsdp.shard) needs the rest of the library loaded first.
function fsdp.shard(...) return require("fsdp.shard").shard(...) end
fsdp.policy = setmetatable({}, { __index = function(_, k) return require("fsdp.shard").policy[k] end })
-- Sharded checkpoints and full export/import (fsdp.checkpoint), loaded on first use.
fsdp.checkpoint = setmetatable({}, { __index = function(_, k) return require("fsdp.checkpoint")[k] end })
function fsdp.save(...) return require("fsdp.checkpoint").save(...) end
function fsdp.load(...) return require("fsdp.checkpoint").load(...) end
function fsdp.latest(...) return require("fsdp.checkpoint").latest(...) end
function fsdp.export(...) return require("fsdp.checkpoint").export(...) end
function fsdp.import(...) return require("fsdp.checkpoint").import(...) end
-- The ranks of the job: rank, world, mean/sum/max/min, broadcast, barrier, print0.
fsdp.distributed = require "fsdp.distributed"

for id, name in pairs(core.dtype_names) do fsdp[name] = name end

local int_box = ffi.new("int[2]")

function fsdp.version()
  local s = ffi.new("const char *[1]")
  if C.fsdp_version(s) ~= 0 then raise() end
  return ffi.string(s[0])
end

function fsdp.set_num_threads(n)
  if C.fsdp_set_num_threads(n) ~= 0 then raise() end
end

function fsdp.num_threads()
  if C.fsdp_get_num_threads(int_box) ~= 0 then raise() end
  return int_box[0]
end

--- This process's rank and the job's rank count (fsdp.distributed has the rest).
function fsdp.rank() return fsdp.distributed.rank() end
function fsdp.world() return fsdp.distributed.world() end

return fsdp
