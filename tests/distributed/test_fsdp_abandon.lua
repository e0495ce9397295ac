-- A backward that fails after some units' gradients were reduce-scattered
-- leaves the gradient shards as they were (zeros after zero_grad): the
-- reductions in flight add nothing that the next backward would build on,
-- also where a reduce-scatter adds its result straight into the shard.
-- A Lua op recorded before the model's forward fails in its backward, which
-- the walk reaches after every unit's reduce-scatter was issued. (Between
-- ranks: a world of one accumulates straight into its gradient shards
-- during the walk, as an unsharded model into its .grad.)
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_abandon.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

local opts = ... or {}
local rank = fsdp.rank()
local model, sharded, x, y = t.sharded_gpt { cfg = { vocab_size = 61, n_layer = 3, n_head = 2, n_embd = 12,
  block_size = 8 }, seed = 3, data_seed = 41, T = 7, strategy = opts.strategy }

local function grads() return t.grad_lists(sharded) end
local function nonzero(all)
  local n = 0
  for _, g in ipairs(all) do
    for _, v in ipairs(g) do if v ~= 0 then n = n + 1 end end
  end
  return n
end
local function same(a, b)
  local differ = 0
  for i = 1, #a do
    for j = 1, #a[i] do if a[i][j] ~= b[i][j] then differ = differ + 1 end end
  end
  return differ
end
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
step(false)   -- a second backward without zero_grad adds: twice the clean gradients
local twice, want = grads(), {}
for i, g in ipairs(clean) do
  want[i] = {}
  for j, v in ipairs(g) do want[i][j] = v + v end
end
t.eq(same(twice, want), 0, string.format("rank %d: a second backward without zero_grad adds to the first", rank))
t.done()
