-- bench_collective_latency.lua: the time of one tiny collective (a sum of
-- one number over the world), queue hand-off and agreement included, as
-- the median over 2000 calls after 50 warm-up calls. Rank 0 prints it.
--   mpirun -np 2 fsdp-lua tests/mpi/bench_collective_latency.lua
local ffi = require "ffi"
local dist = require "fsdp.distributed"

ffi.cdef [[
struct bench_timespec { long tv_sec; long tv_nsec; };
int clock_gettime(int clk, struct bench_timespec *ts);
]]
local ts = ffi.new("struct bench_timespec")
local function now()
  ffi.C.clock_gettime(1, ts)   -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

for _ = 1, 50 do dist.sum(1) end
local n, times = 2000, {}
for i = 1, n do
  local a = now()
  dist.sum(i)
  times[i] = now() - a
end
table.sort(times)
if dist.rank() == 0 then print(string.format("median us per collective: %.1f", times[math.floor(n / 2)] * 1e6)) end
