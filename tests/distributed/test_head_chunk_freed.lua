-- The vocabulary-chunked head and embedding (GPT's head_chunk: the tied
-- table a sliced unit) when the sharded model is freed (collected) between
-- forward and backward: the table's slices can no longer be gathered or
-- reduced, and the backward says so, naming the op, instead of reading
-- through a NULL slicer or a resharded table's NULL buffer.
--   mpirun -np 2 fsdp-lua tests/distributed/test_head_chunk_freed.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"

-- (the schedules are freed by the collector: at the same point on every
-- rank, as freeing their communicators must be)
collectgarbage("stop")
local rank = fsdp.rank()
local cfg = { vocab_size = 61, n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, pad_to = 8, head_chunk = 7 }

-- (a function of its own: its frame, holding the model, is gone when it returns)
local function forward_on_a_model(which)
  local m = nn.GPT(cfg)
  local sharded = fsdp.shard(m, { seed = 3 })
  t.ok(not sharded.direct, which .. ": the table is a sliced unit (not a world of one)")
  local w = m.wte.weight
  if which == "head" then
    local x = fsdp.randn(5, cfg.n_embd, { seed = 1 }):requires_grad(true)
    return fsdp.chunked_cross_entropy(x, w, fsdp.tensor({ 1, 2, 3, 4, 60 }, { dtype = "i64" }), { chunk = 7 })
  end
  return fsdp.chunked_embedding(w, fsdp.tensor({ 1, 2, 60 }, { dtype = "i64" }), { chunk = 7 }):sum()
end

for _, c in ipairs({ { "head", "fsdp_chunked_cross_entropy backward", "weight" },
                     { "embedding", "fsdp_chunked_embedding backward", "table" } }) do
  local out = forward_on_a_model(c[1])
  if jit then jit.flush() end   -- (compiled traces may hold the model)
  collectgarbage()
  collectgarbage()
  t.raises(function() out:backward() end, { c[2], c[3] .. " belongs to a sharded model that was freed before "
    .. "this backward", "[rank " .. rank .. "]" }, c[1] .. ": backward after the sharded model was freed")
  fsdp.tape_clear()
end

-- with the model alive, the same backward runs (the check names only a freed one)
local m = nn.GPT(cfg)
fsdp.shard(m, { seed = 3 })
local x = fsdp.randn(5, cfg.n_embd, { seed = 1 }):requires_grad(true)
local l = fsdp.chunked_cross_entropy(x, m.wte.weight, fsdp.tensor({ 1, 2, 3, 4, 60 }, { dtype = "i64" }), { chunk = 7 })
l:backward()
t.ok(x.grad ~= nil and (x.grad * x.grad):sum():item() > 0, "a live model's chunked head: backward gives dx")
t.done()
