-- On the CUDA emulation: the collectives the schedule issues back to back
-- go out as NCCL groups (ncclGroupStart/End), and that changes nothing that
-- is computed. Schedules that group (forward prefetch: a unit's gather with
-- the next one's; backward_post: a unit's reduce-scatter with the next
-- unit's gather; explicit prefetch lists: their gathers; hybrid_shard's
-- replica averages come right behind each reduce-scatter, never in its
-- group, since they read its output) train bit for bit as the
-- schedule without forward prefetch (backward_pre), which groups nothing:
-- losses, gradient shards and parameters after three AdamW steps.
-- --strategy=hybrid_shard --group-size=2 for the replica averages.
-- --fail=R:N (a test of the failure path, run under expect_fail.sh): world
-- rank R's N-th NCCL group fails to launch; the job must end on every rank.
--   mpirun -np 2 fsdp-lua-emu tests/distributed/test_fsdp_nccl_groups.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local dist = fsdp.distributed
local ffi = require "ffi"

ffi.cdef [[ long long emu_nccl_groups(void); void comm_group_begin(void); void comm_group_end(void); ]]
assert(pcall(function() return ffi.C.emu_nccl_groups end) and fsdp.default_device() == "cuda",
  "this test runs on the CUDA emulation (fsdp-lua-emu)")

local opts = ... or {}
local rank, world = dist.rank(), dist.world()
local cfg = { vocab_size = 97, n_layer = 4, n_head = 3, n_embd = 21, block_size = 8 }
local B, T, STEPS = 2, 8, 3
local blocks = { "h.0", "h.1", "h.2", "h.3" }

local function batch(step) return t.token_batch(step * 7919 + rank * 104729 + 17, B, T, cfg.vocab_size) end

local function train(shard_opts, once)
  local model = nn.GPT(cfg)
  local so = { policy = fsdp.policy.per_block(), seed = 7, strategy = opts.strategy, group_size = opts.group_size }
  for k, v in pairs(shard_opts) do so[k] = v end
  local sharded = fsdp.shard(model, so)
  if once then once(sharded) end
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 3e-3, betas = { 0.9, 0.95 } })
  local g0 = ffi.C.emu_nccl_groups()
  local r = t.train_sharded(model, sharded, opt, batch, STEPS)
  r.groups = tonumber(ffi.C.emu_nccl_groups() - g0)
  return r
end

local function same(a, b, what)
  local d = 0
  for i = 1, #a.losses do d = math.max(d, math.abs(a.losses[i] - b.losses[i])) end
  t.eq(d, 0, what .. ": losses bit for bit")
  t.eq(t.max_abs_diff(a.grads, b.grads), 0, what .. ": gradient shards bit for bit")
  t.eq(t.max_abs_diff(a.params, b.params), 0, what .. ": parameters bit for bit")
end

if opts.fail then
  -- a failed group launch: the error on the failing rank, then the job ends (expect_fail.sh checks how)
  train({ forward_prefetch = true, prefetch = "backward_post" })
  error("the injected group failure was not raised on rank " .. rank)
end

local base = train({ forward_prefetch = false })
local hybrid = opts.strategy == "hybrid_shard"
t.ok(hybrid or base.groups == 0, string.format("rank %d: the ungrouped schedule made %d NCCL groups", rank,
  base.groups))
local variants = {
  { "forward prefetch", { forward_prefetch = true } },
  { "backward_post", { prefetch = "backward_post" } },
  { "prefetch lists", {}, function(sh)
    -- each block's forward gathers the next two, each backward the two before
    for i, name in ipairs(blocks) do
      local fwd, bwd = {}, {}
      for j = i + 1, math.min(i + 2, #blocks) do fwd[#fwd + 1] = blocks[j] end
      for j = i - 1, math.max(i - 2, 1), -1 do bwd[#bwd + 1] = blocks[j] end
      sh:set_prefetch(name, { forward = fwd, backward = bwd })
    end
  end },
}
for _, v in ipairs(variants) do
  local r = train(v[2], v[3])
  same(r, base, v[1])
  -- one rank: no collectives between ranks (a group of one copies locally)
  if world > 1 then
    t.ok(r.groups > 0, string.format("rank %d: %s: %d NCCL groups launched", rank, v[1], r.groups))
  end
  if rank == 0 then print(string.format("%s: %d NCCL groups in %d steps (default schedule: %d)", v[1], r.groups,
    STEPS, base.groups)) end
end
-- the group itself (the engine's comm_group_begin/end): independent collectives go out as one NCCL group;
-- one that reads what an earlier member writes starts a new group after it (same results, in order)
if not hybrid then
  local C = require("fsdp.core").C
  local g = dist.world_group()
  local box = ffi.new("fsdp_work *[2]")
  local function run(issue)
    local g0 = ffi.C.emu_nccl_groups()
    ffi.C.comm_group_begin()
    local ok, err = pcall(issue)
    ffi.C.comm_group_end()
    assert(ok, err)
    for i = 0, 1 do
      assert(C.fsdp_work_wait(box[i]) == 0, ffi.string(C.fsdp_last_error()))
      C.fsdp_work_free(box[i])
    end
    return tonumber(ffi.C.emu_nccl_groups() - g0)
  end
  local a, b = fsdp.tensor({ rank + 1, 2 * rank }), fsdp.tensor({ 3, rank })
  local n = run(function()
    assert(C.fsdp_all_reduce(box, g.comm, a, 0, "group.a") == 0)
    assert(C.fsdp_all_reduce(box + 1, g.comm, b, 0, "group.b") == 0)
  end)
  local sa, sb = world * (world + 1) / 2, world * (world - 1) / 2
  t.eq(table.concat(a:tolist(), ","), string.format("%d,%d", sa, 2 * sb), "independent members: first sum")
  t.eq(table.concat(b:tolist(), ","), string.format("%d,%d", 3 * world, sb), "independent members: second sum")
  t.eq(n, world > 1 and 1 or 0, "two independent all-reduces: one NCCL group")
  local x, full = fsdp.tensor({ rank + 1 }), fsdp.zeros(world)
  n = run(function()
    assert(C.fsdp_all_reduce(box, g.comm, x, 0, "group.x") == 0)
    assert(C.fsdp_all_gather(box + 1, g.comm, full, x, "group.full") == 0)   -- reads x, which the first writes
  end)
  local want = {}
  for r = 1, world do want[r] = sa end
  t.eq(table.concat(full:tolist(), ","), table.concat(want, ","), "a dependent member sees the earlier one's result")
  t.eq(n, 0, "an all-gather of an all-reduce's output: not in its group")
end
t.done()
