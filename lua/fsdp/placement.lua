-- fsdp.placement: where each rank runs, one line per rank, as a cluster
-- job is checked at start-up (fsdp-lua --verbose, or FSDP_VERBOSE=1):
--   rank 2 of 4 on host node1: local rank 0 of 2, device cpu (1 threads)
-- The local rank is the engine's (MPI's shared-memory split), the one that
-- chooses the GPU and splits the cores.
local ffi = require "ffi"
local core = require "fsdp.core"
local C = core.C
local dist = require "fsdp.distributed"

ffi.cdef [[ int gethostname(char *name, size_t len); ]]

local M = {}

--- M.host() -> this process's host name.
function M.host()
  local buf = ffi.new("char[256]")
  if ffi.C.gethostname(buf, 255) ~= 0 then return "?" end
  return ffi.string(buf)
end

--- M.line() -> this rank's placement line.
function M.line()
  local fsdp = require "fsdp"
  local dev = fsdp.default_device()
  local avail, desc = ffi.new("int[1]"), ffi.new("char[256]")
  if C.fsdp_device_info(dev == "cuda" and C.FSDP_DEVICE_CUDA or C.FSDP_DEVICE_CPU, avail, desc, 256) ~= 0 then
    core.raise()
  end
  -- (the CPU's description counts its threads; a GPU rank's host threads are added)
  return string.format("rank %d of %d on host %s: local rank %d of %d, device %s%s", dist.rank(), dist.world(),
                       M.host(), dist.local_rank(), dist.local_size(), ffi.string(desc),
                       dev == "cuda" and string.format(", %d CPU threads", fsdp.num_threads()) or "")
end

--- M.report(): every rank prints its line, in rank order. Collective.
function M.report()
  for r = 0, dist.world() - 1 do
    if r == dist.rank() then
      io.stdout:write(M.line(), "\n")
      io.stdout:flush()
    end
    dist.barrier()
  end
end

return M
