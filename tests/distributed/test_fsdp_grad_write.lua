-- A gradient shard written between zero_grad and the backward keeps what was
-- written: the backward adds its gradients onto it. (The schedule takes a
-- parameter's first gradient as a write only while the shard still holds the
-- zeros it wrote; any other write to the shard ends that.) A backward that
-- fails after such a write leaves the written values, not zeros.
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_grad_write.lua [--bf16]
-- (--bf16: bf16 compute, where a shard group of one widens its gradient into
-- the f32 shard, written into the zeros, added onto anything else)
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

local opts = ... or {}
local rank = fsdp.rank()
local model, sharded, x, y = t.sharded_gpt { cfg = { vocab_size = 53, n_layer = 2, n_head = 2, n_embd = 12,
  block_size = 8 }, seed = 5, data_seed = 17, T = 5, strategy = opts.strategy,
  mixed_precision = opts.bf16 and { compute = "bf16" } or nil }

local function grads() return t.grad_lists(sharded) end
local function step()
  local _, l = model(x, y)
  l:backward()
end
-- the shards' values plus c, elementwise
local function plus(all, c)
  local out = {}
  for i, g in ipairs(all) do
    out[i] = {}
    for j, v in ipairs(g) do out[i][j] = v + c end
  end
  return out
end
-- values of a and b further apart than tol (a world of one adds a parameter's
-- gradient into the shard part by part, so onto 0.5 it rounds differently)
local differ = t.count_differ
local TOL = 1e-6   -- f32 rounding at 0.5 is 3e-8 an add; an overwrite or a re-zeroing is off by 0.25 or more

step()
local clean = grads()
t.ok(#clean > 0 and #clean[1] > 0, "the model has gradient shards")

sharded:zero_grad()
for _, g in ipairs(sharded.grads) do g:fill(0.5) end
step()
t.eq(differ(grads(), plus(clean, 0.5), TOL), 0, string.format(
  "rank %d: a shard filled with 0.5 after zero_grad takes the backward's gradients as adds", rank))

sharded:zero_grad()
for _, g in ipairs(sharded.grads) do g:fill(0.25) end
local ok, err = pcall(t.lm_backward, model, x, y, true)
t.ok(not ok and tostring(err):find("boom", 1, true) ~= nil, "the backward fails in the failing op: " .. tostring(err))
local after = grads()
local kept, added = 0, plus(clean, 0.25)
for i, g in ipairs(after) do
  for j, v in ipairs(g) do
    if v == 0.25 or math.abs(v - added[i][j]) <= TOL then kept = kept + 1 end
  end
end
local total = 0
for _, g in ipairs(after) do total = total + #g end
t.eq(kept, total, string.format("rank %d: a failed backward does not zero a shard the user wrote (each value 0.25, "
  .. "or 0.25 plus its gradient where the failure came after the add)", rank))

sharded:zero_grad()
step()
t.eq(differ(grads(), clean), 0, string.format("rank %d: after zero_grad the clean gradients again, bit for bit", rank))

-- A shard holding the schedule's sums is never taken for its zeros (every
-- write of the schedule ends them, the storage version only tells of other
-- writers): a second backward, or one after a no_sync micro-batch, adds.
-- (bf16: micro-batches add in the flat bf16 gradient, roundings of 2^-8 of
-- the terms; a write instead of an add would be off by the gradient itself)
local twice, biggest = plus(clean, 0), 0
for _, g in ipairs(twice) do
  for j, v in ipairs(g) do
    g[j] = v + v
    biggest = math.max(biggest, math.abs(v + v))
  end
end
local function far_from_twice() return differ(grads(), twice, opts.bf16 and 2 ^ -6 * biggest or TOL) end
step()
t.eq(far_from_twice(), 0, string.format("rank %d: a second backward without zero_grad adds onto the first (max diff "
  .. "%.3g)", rank, t.max_abs_diff(grads(), twice)))
sharded:zero_grad()
sharded:no_sync(step)
step()
t.eq(far_from_twice(), 0, string.format("rank %d: a backward after a no_sync one adds the two (max diff %.3g)", rank,
  t.max_abs_diff(grads(), twice)))
t.done()
