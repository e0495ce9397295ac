-- The vocabulary-chunked LM head and loss (fsdp.chunked_cross_entropy) and
-- embedding against the unchunked ops, on one rank: loss and the gradients
-- of x and of the table at awkward sizes (V prime, chunks that do not
-- divide V, a chunk of one row, one larger than V, padded vocabulary rows,
-- one token), a GPT (and a Llama) with config.head_chunk against the same model without
-- (loss, every gradient, sampling), and bad input. (Sharded: the
-- distributed equiv.head_chunk and memory.head_chunk tests. Under fsdp-lua-emu: the CUDA kernels.)
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"

local TOL = 1e-5

local function targets_for(N, valid, seed)
  local list, s = {}, seed
  for n = 1, N do
    s = (s * 48271) % 2147483647
    list[n] = (n % 4 == 3) and -100 or s % valid
  end
  if N > 1 then list[N] = valid - 1 end
  return fsdp.tensor(list, { dtype = "i64" })
end

-- ---- the op against matmul + cross_entropy ----
local cases = {
  { N = 5, V = 97, valid = 97, C = 8, chunk = 10, what = "V prime, chunk 10" },
  { N = 1, V = 97, valid = 89, C = 8, chunk = 7, what = "one token, padded rows" },
  { N = 6, V = 64, valid = 61, C = 4, chunk = 64, what = "one chunk" },
  { N = 4, V = 13, valid = 13, C = 3, chunk = 1, what = "a row per chunk" },
  { N = 3, V = 50, valid = 50, C = 5, chunk = 1000, what = "chunk larger than V" },
}
for k, c in ipairs(cases) do
  local function inputs()
    local x = fsdp.randn(c.N, c.C, { seed = 10 + k }):requires_grad(true)
    local w = (fsdp.randn(c.V, c.C, { seed = 20 + k }) * 0.7):detach():requires_grad(true)
    return x, w
  end
  local y = targets_for(c.N, c.valid, 31 + k)
  local x0, w0 = inputs()
  local l0 = fsdp.cross_entropy(x0:matmul(w0, { tb = true }), y, { valid_vocab = c.valid })
  l0:backward()
  local x1, w1 = inputs()
  local l1 = fsdp.chunked_cross_entropy(x1, w1, y, { chunk = c.chunk, valid_vocab = c.valid })
  l1:backward()
  t.near(l1:item(), l0:item(), TOL, c.what .. ": loss")
  t.ok(t.rel_err(x1.grad, x0.grad) <= TOL, string.format("%s: dx (rel %.2g)", c.what, t.rel_err(x1.grad, x0.grad)))
  t.ok(t.rel_err(w1.grad, w0.grad) <= TOL, string.format("%s: dweight (rel %.2g)", c.what, t.rel_err(w1.grad, w0.grad)))
  fsdp.no_grad(function()
    local lg = fsdp.chunked_logits(x1, w1, { chunk = c.chunk })
    t.ok(t.rel_err(lg, x1:matmul(w1, { tb = true })) <= TOL, c.what .. ": chunked logits = x @ w^T")
  end)
end

-- bf16: the same op on bf16 tensors, against the unchunked bf16 path
do
  local x = fsdp.randn(4, 8, { seed = 3 }):bf16()
  local w = fsdp.randn(29, 8, { seed = 4 }):bf16()
  local y = targets_for(4, 29, 5)
  local l0 = fsdp.cross_entropy(x:matmul(w, { tb = true }), y)
  local l1 = fsdp.chunked_cross_entropy(x, w, y, { chunk = 6 })
  t.eq(l1:dtype(), "bf16", "bf16 in, bf16 loss")
  t.near(l1:float():item(), l0:float():item(), 2e-2, "bf16: the loss of the unchunked path")
end

-- ---- a GPT with head_chunk trains as the same GPT without ----
local function gpt_run(chunk, T)
  local cfg = { vocab_size = 61, n_layer = 2, n_head = 2, n_embd = 16, block_size = 8, pad_to = 8, head_chunk = chunk }
  local m = nn.GPT(cfg):materialize { seed = 5 }
  local x, y = t.token_batch(77, 3, T, 61)
  local logits, loss = m(x, y)
  loss:backward()
  local grads = {}
  for _, p in ipairs(m:named_parameters()) do grads[p.path] = p.tensor.grad end
  return m, loss:item(), grads, logits
end
for _, T in ipairs({ 8, 1 }) do
  local m0, l0, g0 = gpt_run(nil, T)
  for _, chunk in ipairs({ 5, 64 }) do
    local _, l1, g1, logits = gpt_run(chunk, T)
    local what = string.format("GPT T=%d head_chunk=%d", T, chunk)
    t.near(l1, l0, TOL, what .. ": loss")
    t.eq(logits, nil, what .. ": no logits with targets")
    local worst, worst_path = 0, "-"
    for path, g in pairs(g0) do
      local e = t.rel_err(g1[path], g)
      if e > worst then worst, worst_path = e, path end
    end
    t.ok(worst <= TOL, string.format("%s: every gradient (worst %s, rel %.2g)", what, worst_path, worst))
  end
  if T == 8 then
    local m1 = gpt_run(7, T)
    local prompt = fsdp.tensor({ { 1, 2, 3 } }, { dtype = "i64" })
    t.eq(t.show(m1:generate(prompt, 4, { temperature = 0 })), t.show(m0:generate(prompt, 4, { temperature = 0 })),
      "GPT head_chunk: the same greedy samples")
  end
end

-- the Llama variant (an untied head): the same loss and gradients with head_chunk
do
  local function llama(chunk)
    local m = nn.Llama { vocab_size = 45, n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, pad_to = 16,
      head_chunk = chunk }
    m:materialize { seed = 9 }
    local x, y = t.token_batch(5, 2, 6, 45)
    local _, loss = m(x, y)
    loss:backward()
    return loss:item(), m.lm_head.weight.grad, m.wte.weight.grad
  end
  local l0, h0, e0 = llama(nil)
  local l1, h1, e1 = llama(11)
  t.near(l1, l0, TOL, "Llama head_chunk: loss")
  t.ok(t.rel_err(h1, h0) <= TOL and t.rel_err(e1, e0) <= TOL, "Llama head_chunk: head and embedding gradients")
end

-- ---- bad input ----
local x, w = fsdp.randn(3, 4, { seed = 1 }), fsdp.randn(7, 4, { seed = 2 })
local y = fsdp.tensor({ 1, 2, 6 }, { dtype = "i64" })
for _, bad in ipairs({ 0, -3, 2.5, 0 / 0, math.huge }) do
  t.raises(function() fsdp.chunked_cross_entropy(x, w, y, { chunk = bad }) end,
    { "fsdp.chunked_cross_entropy", "chunk must be a positive whole number", tostring(bad) },
    "chunk " .. tostring(bad) .. " is refused")
end
t.raises(function() fsdp.chunked_cross_entropy(x, w, y, { chunk = "8" }) end, { "chunk", "string" },
  "a string chunk is refused")
t.raises(function() fsdp.chunked_cross_entropy(x, w, y) end, { "options { chunk = rows } are required" },
  "no chunk given")
t.raises(function() fsdp.chunked_cross_entropy(x, w, y, { chunk = 2, chunks = 3 }) end, { "chunks" },
  "a misspelled option")
t.raises(function() fsdp.chunked_embedding(w, y, { chunk = 0 }) end, { "fsdp.chunked_embedding", "chunk" },
  "embedding: chunk 0")
t.raises(function() fsdp.chunked_logits(x, w, { chunk = -1 }) end, { "fsdp.chunked_logits", "chunk" },
  "logits: chunk -1")
t.raises(function() fsdp.chunked_cross_entropy(x, w, fsdp.tensor({ 1, 2, 7 }, { dtype = "i64" }), { chunk = 2 }) end,
  { "fsdp_chunked_cross_entropy", "targets[2] is 7", "f32[7,4]" }, "a target past the vocabulary, named")
t.raises(function() fsdp.chunked_cross_entropy(x, fsdp.randn(7, 5, { seed = 3 }), y, { chunk = 2 }) end,
  { "fsdp_chunked_cross_entropy", "C = 5" }, "x and weight widths differ")
t.raises(function() fsdp.chunked_cross_entropy(x, w, y, { chunk = 2, valid_vocab = 8 }) end,
  { "valid_vocab is 8" }, "valid_vocab past V")
t.raises(function() fsdp.chunked_embedding(w, fsdp.tensor({ 7 }, { dtype = "i64" }), { chunk = 3 }) end,
  { "fsdp_embedding", "7" }, "embedding: an id past the table")
local xg = fsdp.randn(3, 4, { seed = 1 }):requires_grad(true)
t.raises(function() fsdp.chunked_logits(xg, w, { chunk = 2 }) end, { "fsdp_chunked_logits", "no_grad" },
  "chunked logits refuse to record a gradient")
for _, bad in ipairs({ 0, -1, 1.5 }) do
  t.raises(function()
    nn.GPT { vocab_size = 61, n_layer = 1, n_head = 2, n_embd = 16, block_size = 8, head_chunk = bad }
  end, { "GPT", "head_chunk", tostring(bad) }, "GPT config head_chunk " .. tostring(bad) .. " is refused")
end
t.done()
