-- A backward that fails after some units' gradients were reduce-scattered
-- leaves the gradient shards as they were (zeros after zero_grad): the
-- reductions in flight add nothing that the next backward would build on,
-- also where a reduce-scatter adds its result straight into the shard, and
-- in a world of one, whose gradients accumulate into the shards during the
-- walk. A Lua op recorded before the model's forward fails in its backward,
-- which the walk reaches after every unit's reduce-scatter was issued.
-- Without sync too: a failed first micro-batch leaves nothing for the next.
-- (--head-chunk=R: the head by vocabulary chunks, the tied embedding a sliced
-- unit whose slices are reduced into its shard during the walk; --offload:
-- on a GPU, the shards on the host, reductions added there)
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_abandon.lua [--strategy=S] [--bf16] [--head-chunk=R]
--     [--offload]
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

local opts = ... or {}
local rank = fsdp.rank()
local model, sharded, x, y = t.sharded_gpt { cfg = { vocab_size = 61, n_layer = 3, n_head = 2, n_embd = 12,
  block_size = 8, head_chunk = opts.head_chunk }, seed = 3, data_seed = 41, T = 7, strategy = opts.strategy,
  mixed_precision = opts.bf16 and { compute = "bf16" } or nil, offload = opts.offload }

if opts.offload then t.ok(sharded.offload, "--offload: the shards live on the host (the test runs on a GPU)") end
local function grads() return t.grad_lists(sharded) end
local function nonzero(all)
  local n = 0
  for _, g in ipairs(all) do
    for _, v in ipairs(g) do if v ~= 0 then n = n + 1 end end
  end
  return n
end
-- values of a and b further apart than tol (default 0: bit for bit)
local same = t.count_differ
local function step(fail) return t.lm_backward(model, x, y, fail) end

step(false)
local clean = grads()
t.ok(nonzero(clean) > 0, string.format("rank %d: a clean backward fills the gradient shards (%d nonzero values)", rank,
  nonzero(clean)))
sharded:zero_grad()
t.eq(nonzero(grads()), 0, "zero_grad zeroes the gradient shards")

local ok, err = pcall(step, true)
t.ok(not ok and tostring(err):find("boom", 1, true) ~= nil, "the backward fails with the Lua op's error: "
  .. tostring(err))
t.eq(nonzero(grads()), 0, string.format("rank %d: after the failed backward every gradient shard still holds zeros",
  rank))

step(false)
t.eq(same(grads(), clean), 0, string.format("rank %d: the next backward gives the clean gradients bit for bit", rank))
-- a second backward without zero_grad adds: twice the clean gradients (a world of one adds a parameter's gradient
-- into the shard part by part, as an unsharded model into .grad, and so does a sliced unit, slice reduction after
-- slice reduction, so there it rounds differently: a few f32 ulps of the largest gradient, where a write instead
-- of an add, or a restored zero, is off by the gradient itself)
local twice, biggest = {}, 0
for i, g in ipairs(clean) do
  twice[i] = {}
  for j, v in ipairs(g) do
    twice[i][j] = v + v
    biggest = math.max(biggest, math.abs(v + v))
  end
end
local tol = (sharded.direct or opts.head_chunk) and 2 ^ -20 * biggest or 0
step(false)
t.eq(same(grads(), twice, tol), 0, string.format("rank %d: a second backward without zero_grad adds to the first "
  .. "(max diff %.3g)", rank, t.max_abs_diff(grads(), twice)))

-- without sync: a micro-batch that fails first after zero_grad leaves nothing behind (neither in the shards nor
-- in a flat gradient kept for the next micro-batch); two micro-batches after it add up to twice the gradients
-- (micro-batches add part by part in the flat gradient: f32 ulps, or bf16 roundings of 2^-8 of the terms; three
-- times the gradients, the failed micro-batch's kept, would be off by the gradient itself)
local accum_tol = (opts.bf16 and 2 ^ -6 or 2 ^ -20) * biggest
sharded:zero_grad()
ok, err = pcall(sharded.no_sync, sharded, step, true)
t.ok(not ok and tostring(err):find("boom", 1, true) ~= nil, "the no_sync backward fails with the Lua op's error: "
  .. tostring(err))
t.eq(nonzero(grads()), 0, string.format("rank %d: after the failed no_sync backward every gradient shard holds zeros",
  rank))
sharded:no_sync(step, false)
step(false)
t.eq(same(grads(), twice, accum_tol), 0, string.format("rank %d: then a no_sync backward and a synced one add the two "
  .. "(max diff %.3g)", rank, t.max_abs_diff(grads(), twice)))
t.done()
