-- fsdp.timer: wall-clock time in seconds (os.clock counts CPU time, which
-- grows with every thread).
local ffi = require "ffi"
ffi.cdef [[
  typedef struct { long tv_sec; long tv_nsec; } fsdp_timespec;
  int clock_gettime(int clk_id, fsdp_timespec *tp);
]]
local ts = ffi.new("fsdp_timespec")
local CLOCK_MONOTONIC = 1
local M = {}
function M.now()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end
return M
