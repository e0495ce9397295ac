-- Bad input to fsdp.shard: each case must give a clear error on every rank
-- and end the job with a non-zero exit, never hang. One case per run:
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_errors.lua --case=policy      a policy returning a non-boolean
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_errors.lua --case=shared      two units sharing one module
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_errors.lua --case=disagree    rank 1 builds a wider model
--   mpirun -np 3 fsdp-lua tests/distributed/test_fsdp_errors.lua --case=hybrid      group_size 2 on 3 ranks
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_errors.lua --case=prefetch    a prefetch list naming no unit
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_errors.lua --case=hpz         reshard_after_forward = 3 on 2 ranks
-- Each rank catches its error, prints it, and the ranks count how many of
-- them raised one (an all-reduce: a rank that did not raise would leave the
-- others waiting, and the 60 s limit of expect_fail.sh would call it a
-- hang). Once rank 0 has printed the count (a barrier: see below), every
-- rank raises the error again, uncaught: the launcher
-- ends the job with that message and a non-zero exit, which is what
-- tests/distributed/expect_fail.sh requires, together with the expected message.
local ffi = require "ffi"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"

local opts = ... or {}
local rank, world = fsdp.rank(), fsdp.world()
local C = require("fsdp.core").C   -- the binding, to count ranks without the library

local cfg = { vocab_size = 64, n_layer = 2, n_head = 2, n_embd = 16, block_size = 8 }

local cases = {}

-- a policy must answer true or false
function cases.policy()
  local model = nn.GPT(cfg)
  fsdp.shard(model, { policy = function(m) return m.__name == "Block" and "yes" or false end })
end

-- a policy selecting modules that cannot be units: a container without a
-- forward of its own, and the tied token embedding
function cases.modulelist()
  fsdp.shard(nn.GPT(cfg), { policy = fsdp.policy.by_type("ModuleList") })
end
function cases.tied()
  fsdp.shard(nn.GPT(cfg), { policy = fsdp.policy.by_type("Embedding") })
end

-- two blocks share one MLP object: wrapped per block, its parameters
-- would belong to two units
function cases.shared()
  local model = nn.GPT(cfg)
  model.h:get(1).mlp = model.h:get(0).mlp
  fsdp.shard(model, { policy = fsdp.policy.per_block() })
end

-- rank 1 builds a wider model than the others
function cases.disagree()
  local c = {}
  for k, v in pairs(cfg) do c[k] = v end
  if rank == 1 then c.n_embd = 32 end
  fsdp.shard(nn.GPT(c), { policy = fsdp.policy.per_block() })
end

-- hybrid sharding in groups of 2 cannot split 3 ranks
function cases.hybrid()
  fsdp.shard(nn.GPT(cfg), { policy = fsdp.policy.per_block(), strategy = "hybrid_shard", group_size = 2 })
end

-- an explicit prefetch list naming a unit that does not exist
function cases.prefetch()
  local sharded = fsdp.shard(nn.GPT(cfg), { policy = fsdp.policy.per_block() })
  sharded:set_prefetch("h.0", { forward = { "h.1", "h.2" } })
end

-- reshard_after_forward as a group size that does not divide the shard group
function cases.hpz()
  fsdp.shard(nn.GPT(cfg), { policy = fsdp.policy.per_block(), reshard_after_forward = 3 })
end

local fn = cases[opts.case]
if not fn then
  local names = {}
  for k in pairs(cases) do names[#names + 1] = k end
  table.sort(names)
  error("test_fsdp_errors.lua: --case must be one of " .. table.concat(names, ", ") .. ", got " ..
    tostring(opts.case), 0)
end

local ok, err = pcall(fn)
if ok then
  print(string.format("rank %d: case %s raised no error", rank, opts.case))
  io.stdout:flush()
  os.exit(3)
end
err = tostring(err)
print(string.format("rank %d: case %s: caught: %s", rank, opts.case, err))
io.stdout:flush()

-- how many ranks raised (every rank that gets here did)
local box = ffi.new("fsdp_comm *[1]")
if C.fsdp_comm_world(box) ~= 0 then require("fsdp.core").raise() end
local count = ffi.new("double[1]", 1)
if C.fsdp_all_reduce_doubles(box[0], count, 1, 0) ~= 0 then require("fsdp.core").raise() end
if rank == 0 then
  print(string.format("case %s: the error was raised on %d of %d ranks", opts.case, count[0], world))
  io.stdout:flush()
end
-- The first uncaught error ends the whole job (MPI_Abort): no rank may get
-- there before rank 0 has written its report, or the report is lost.
if C.fsdp_barrier(box[0]) ~= 0 then require("fsdp.core").raise() end
error(err, 0)
