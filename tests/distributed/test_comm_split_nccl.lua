-- On the CUDA emulation: sub-communicators of a communicator that has an
-- NCCL side get theirs by ncclCommSplit (no unique id, no ncclCommInitRank),
-- with the members and order of the host split; one without an NCCL side
-- yet makes its own on its first CUDA collective, as before. Checked by the
-- results of CUDA collectives on each group (sums and gathers of values
-- that name the ranks) and by the emulation's counts of communicators made
-- and split.
--   mpirun -np 3 fsdp-lua-emu tests/distributed/test_comm_split_nccl.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local dist = fsdp.distributed
local ffi = require "ffi"
local C = require("fsdp.core").C

ffi.cdef [[ int emu_nccl_comms_made(void); int emu_nccl_comms_split(void); int emu_nccl_comms_live(void); ]]
assert(pcall(function() return ffi.C.emu_nccl_comms_split end) and fsdp.default_device() == "cuda",
  "this test runs on the CUDA emulation (fsdp-lua-emu)")

local rank, world = dist.rank(), dist.world()
local REDUCE_SUM = 0
local box = ffi.new("fsdp_comm *[1]")

local function raise_if(st, what)
  if st ~= 0 then error(what .. ": " .. ffi.string(C.fsdp_last_error()), 2) end
end

-- the sum over g's members of (world rank + 1) * (i + 1), for i = 0 .. n - 1, on the GPU
local function cuda_sum(g, n)
  local v = {}
  for i = 1, n do v[i] = (rank + 1) * i end
  local x = fsdp.tensor(v)
  t.eq(x:device(), "cuda", "the tensor is on the GPU")
  raise_if(C.fsdp_all_reduce(nil, g.comm, x, REDUCE_SUM, "split.sum"), "all_reduce")
  return x:tolist()
end

-- every member's world rank, gathered in the group's rank order, on the GPU
local function cuda_ranks(g)
  local full = fsdp.zeros(g:size())
  raise_if(C.fsdp_all_gather(nil, g.comm, full, fsdp.tensor({ rank }), "split.ranks"), "all_gather")
  local r = full:tolist()
  for i = 1, #r do r[i] = math.floor(r[i] + 0.5) end
  return r
end

-- the world ranks of color c, in the order of (key, world rank)
local function members(color_of, key_of, c)
  local m = {}
  for r = 0, world - 1 do
    if color_of(r) == c then m[#m + 1] = r end
  end
  table.sort(m, function(a, b)
    local ka, kb = key_of(a), key_of(b)
    if ka ~= kb then return ka < kb end
    return a < b
  end)
  return m
end

local function check_group(g, color_of, key_of, what)
  local want = members(color_of, key_of, color_of(rank))
  t.eq(g:size(), #want, what .. ": size")
  local got = cuda_ranks(g)
  t.eq(table.concat(got, ","), table.concat(want, ","), what .. ": members in rank order (gathered on the GPU)")
  for i, r in ipairs(want) do
    if r == rank then t.eq(g:rank(), i - 1, what .. ": this rank's place") end
  end
  local n, wsum = 5, 0
  for _, r in ipairs(want) do wsum = wsum + r + 1 end
  local s = cuda_sum(g, n)
  for i = 1, n do t.eq(s[i], wsum * i, string.format("%s: sum element %d", what, i)) end
end

local made0, split0 = ffi.C.emu_nccl_comms_made(), ffi.C.emu_nccl_comms_split()

-- 1. the world has no NCCL side yet: its split makes its own, on first use (the old path)
local wg = dist.world_group()
local parity = function(r) return r % 2 end
local by_rank = function(r) return r end
local early = wg:split(parity(rank))
check_group(early, parity, by_rank, "split of a parent without NCCL")
t.eq(ffi.C.emu_nccl_comms_split() - split0, 0, "no ncclCommSplit from a parent without an NCCL side")
t.eq(ffi.C.emu_nccl_comms_made() - made0, 1, "the child made its NCCL side with ncclCommInitRank")

-- 2. the world gets its NCCL side (its first CUDA collective), then splits derive from it
check_group(wg, function() return 0 end, by_rank, "world")
local made1, split1 = ffi.C.emu_nccl_comms_made(), ffi.C.emu_nccl_comms_split()
t.eq(made1 - made0, 2, "the world made its NCCL side with ncclCommInitRank")
-- keys reversed: the child ranks run against the world's
local reversed = function(r) return -r end
local g = wg:split(parity(rank), reversed(rank))
check_group(g, parity, reversed, "split by parity, keys reversed")
-- split_all: colors in thirds, keys by world rank
local third = function(r) return math.floor(3 * r / world) end
local g3 = wg:split_by(function(r) return third(r), r end)
check_group(g3, third, by_rank, "split_by thirds")
-- a split of a split (its parent got its NCCL side by ncclCommSplit)
local gg = g:split(0, g:rank())
check_group(gg, parity, reversed, "split of a split")
t.eq(ffi.C.emu_nccl_comms_made(), made1, "no ncclCommInitRank for children of a parent with NCCL")
t.eq(ffi.C.emu_nccl_comms_split() - split1, 3, "three ncclCommSplit communicators")

-- 3. a rank left out (a negative color through the C API): it takes part, is refused, and the others go on
local st = C.fsdp_comm_split(box, wg.comm, rank == 0 and -1 or 0, rank)
if rank == 0 then
  t.ok(st ~= 0, "a negative color is refused on its rank")
  t.ok(ffi.string(C.fsdp_last_error()):find("color %-1", 1) ~= nil, "the message names the color: "
    .. ffi.string(C.fsdp_last_error()))
else
  raise_if(st, "fsdp_comm_split")
  local rest = dist._borrow(box[0])
  check_group(rest, function(r) return r == 0 and -1 or 0 end, by_rank, "split without rank 0")
  C.fsdp_comm_free(box[0])
end
t.eq(ffi.C.emu_nccl_comms_made(), made1, "still no ncclCommInitRank")
-- every rank of the world still in step: one more CUDA collective on all of it
check_group(wg, function() return 0 end, by_rank, "world after the splits")

-- 4. a split whose wait is abandoned (the REPL's fsdp_comm_abandon): the queue drops the child when the split is
-- done, its NCCL side (by ncclCommSplit: the world has one) with it
local live0 = ffi.C.emu_nccl_comms_live()
t.eq(C.fsdp_comm_abandon("a split nobody waits for", nil), 0, "fsdp_comm_abandon")
local ast = C.fsdp_comm_split(box, wg.comm, 0, rank)
t.eq(C.fsdp_comm_abandon(nil, nil), 0, "fsdp_comm_abandon off")
if ast == 0 then   -- (the split finished before the wait looked: an ordinary child)
  C.fsdp_comm_free(box[0])
else
  t.ok(ffi.string(C.fsdp_last_error()):find("abandoned", 1, true) ~= nil, "the wait was abandoned: "
    .. ffi.string(C.fsdp_last_error()))
end
-- a collective after it on every rank: the comm thread has finished the split (and dropped its child) first
check_group(wg, function() return 0 end, by_rank, "world after an abandoned split")
t.eq(ffi.C.emu_nccl_comms_live(), live0, "no NCCL communicator left of the abandoned split")

local live1 = ffi.C.emu_nccl_comms_live()
for _, x in ipairs({ gg, g3, g, early }) do x:free() end
dist.world_group():barrier()
t.eq(ffi.C.emu_nccl_comms_live(), live1 - 4, "the four groups' NCCL communicators destroyed with them")
if rank == 0 then
  print(string.format("%d ranks: %d communicators by ncclCommSplit, %d by ncclCommInitRank", world,
    ffi.C.emu_nccl_comms_split() - split0, ffi.C.emu_nccl_comms_made() - made0))
end
t.done()
