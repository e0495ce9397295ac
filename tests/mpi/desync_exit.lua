-- desync_exit.lua: rank 1 leaves a running job early, from Lua, while the
-- others go on to their next collective. They must name it and the job must
-- end, non-zero, within seconds (not at the watchdog). One case per run:
--   mpirun -np 2 fsdp-lua tests/mpi/desync_exit.lua --case=os_exit   rank 1 calls os.exit(0)
--   mpirun -np 2 fsdp-lua tests/mpi/desync_exit.lua --case=return    rank 1 returns from the program
local dist = require "fsdp.distributed"

local opts = ... or {}
assert(opts.case == "os_exit" or opts.case == "return", "--case must be os_exit or return")
local rank = dist.rank()
assert(dist.sum(1) == dist.world(), "warm-up sum")
if rank == 1 then
  io.stderr:write("rank 1 leaves (" .. opts.case .. ")\n")
  if opts.case == "os_exit" then os.exit(0) end
  return
end
dist.sum(1)   -- must fail: rank 1 is gone
io.stderr:write("rank " .. rank .. ": the collective after rank 1 left succeeded\n")
