-- The local rank comes from MPI's shared-memory split, not a launcher's
-- variable: on one host every rank is on the node, so the local ranks are
-- 0..N-1, each once, and the local size is N on every rank; a world of one
-- is rank 0 of 1.
--   mpirun -np N fsdp-lua tests/distributed/test_local_rank.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local dist = require "fsdp.distributed"

local world = dist.world()
local lr, ls = dist.local_rank(), dist.local_size()
t.eq(ls, world, "local size: every rank shares this host")
t.ok(lr >= 0 and lr < ls, string.format("local rank %d within 0..%d", lr, ls - 1))
-- each local rank once: the bits 2^lr sum to 2^N - 1
t.eq(dist.sum(2 ^ lr), 2 ^ world - 1, "local ranks are 0..N-1, each once")
t.eq(dist.max(ls), dist.min(ls), "every rank sees the same local size")
-- on one host the split keeps the world's order (key = world rank)
t.eq(lr, dist.rank(), "local rank follows the world rank on one host")
t.done()
