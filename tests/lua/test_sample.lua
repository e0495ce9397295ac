-- fsdp.sample against independent references: the splitmix64 stream's
-- published outputs, the kept tokens and their probabilities as PyTorch
-- computes them (Hugging Face's top_k_top_p_filtering, float64), the
-- frequencies of many draws against those probabilities, and generation
-- against a plain greedy loop over the model's own forwards.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local sample = require "fsdp.sample"

-- splitmix64 from seed 0 (its reference outputs)
do
  local r = sample.rng(0)
  t.eq(r:next_u64(), 0xE220A8397B1DCDAFULL, "splitmix64 #1")
  t.eq(r:next_u64(), 0x6E789E6AA1B965F4ULL, "splitmix64 #2")
  t.eq(r:next_u64(), 0x06C45D188009454FULL, "splitmix64 #3")
  local u = sample.rng(12345)
  t.eq(u:uniform(), 1198675092388386 / 2 ^ 53, "uniform is the top 53 bits")
end

-- The probabilities torch gives for these logits (float64):
--   l = logits / temp; l[l < topk(l, k)[-1]] = -inf (k > 0);
--   sorted, drop where cumsum(softmax) > p shifted by one (p < 1); softmax(l)
local logits = { 1.5, -0.3, 2.2, 0.0, 2.2, -1.7, 0.9, 3.1, -0.5, 1.1, 0.4 }
local torch_probs = {
  { 0.8, 5, 1.0, { 0.0724987706, 0, 0.1739155096, 0, 0.1739155096, 0, 0, 0.5356974830, 0, 0.0439727272, 0 } },
  { 1.0, 0, 0.9, { 0.0892883489, 0, 0.1798046544, 0, 0.1798046544, 0, 0.0490024849, 0.4422480873, 0, 0.0598517702, 0 } },
  { 0.7, 4, 0.8, { 0, 0, 0.1780230291, 0, 0.1780230291, 0, 0, 0.6439539418, 0, 0, 0 } },
  { 1.3, 0, 1.0, { 0.0951386721, 0.0238246355, 0.1630076403, 0.0300087612, 0.1630076403, 0.0081156725, 0.0599671596,
    0.3257417094, 0.0204273358, 0.0699403843, 0.0408203890 } },
  { 1.0, 2, 1.0, { 0, 0, 0.2242352010, 0, 0.2242352010, 0, 0, 0.5515295980, 0, 0, 0 } },   -- a tie at the k-th
  { 0.9, 6, 0.85, { 0.0887315111, 0, 0.1931356629, 0, 0.1931356629, 0, 0, 0.5249971630, 0, 0, 0 } },
}
local function dense(d, n)
  local p = {}
  for v = 1, n do p[v] = 0 end
  for i, id in ipairs(d.ids) do p[id + 1] = d.probs[i] end
  return p
end
for _, c in ipairs(torch_probs) do
  local name = string.format("temperature %g top_k %d top_p %g", c[1], c[2], c[3])
  local d = sample.distribution(logits, { temperature = c[1], top_k = c[2], top_p = c[3] })
  local p, worst, mask_ok = dense(d, #logits), 0, true
  for v = 1, #logits do
    worst = math.max(worst, math.abs(p[v] - c[4][v]))
    if (p[v] > 0) ~= (c[4][v] > 0) then mask_ok = false end
  end
  t.ok(mask_ok, name .. ": the kept tokens are torch's")
  t.ok(worst < 1e-9, name .. string.format(": probabilities as torch's (max diff %.2e)", worst))
  local sorted = true
  for i = 2, #d.probs do if d.probs[i] > d.probs[i - 1] then sorted = false end end
  t.ok(sorted, name .. ": most likely first")
end

-- 40000 draws land on each token about as often as its probability says
-- (within 4.5 standard deviations of the binomial count; seeded, so fixed)
do
  local want = torch_probs[1][4]
  local d = sample.distribution(logits, { temperature = 0.8, top_k = 5 })
  local r, N, count = sample.rng(7), 40000, {}
  for v = 1, #logits do count[v] = 0 end
  for _ = 1, N do
    local id = sample.draw(d, r:uniform())
    count[id + 1] = count[id + 1] + 1
  end
  local ok, worst = true, 0
  for v = 1, #logits do
    local sd = math.sqrt(N * want[v] * (1 - want[v]))
    local z = sd > 0 and math.abs(count[v] - N * want[v]) / sd or (count[v] == 0 and 0 or math.huge)
    worst = math.max(worst, z)
    if z > 4.5 then ok = false end
  end
  t.ok(ok, string.format("draw frequencies follow the probabilities (worst %.2f sd)", worst))
end

-- greedy: the largest logit, the lowest id among equals; a padded
-- vocabulary's tail never comes out
t.eq(sample.distribution(logits, { temperature = 0 }).ids[1], 7, "temperature 0 is argmax")
t.eq(sample.distribution(logits, { top_k = 1 }).ids[1], 7, "top_k 1 is argmax")
t.eq(sample.distribution({ 1, 5, 5, 2 }, { temperature = 0 }).ids[1], 1, "argmax ties go to the lower id")
t.eq(#sample.distribution({ 1, 2, 3, 99 }, { top_k = 0, vocab_size = 3 }).ids, 3, "ids past vocab_size are left out")

-- errors name the option
t.raises(function() sample.distribution(logits, { top_p = 0 }) end, { "top_p must be in (0, 1]" }, "top_p 0")
t.raises(function() sample.distribution(logits, { temperature = -1 }) end, { "temperature must be a number >= 0" },
  "negative temperature")
t.raises(function() sample.distribution(logits, { top_k = 2.5 }) end, { "top_k must be an integer >= 0" }, "top_k 2.5")
t.raises(function() sample.distribution(logits, { topp = 0.5 }) end, { "unknown option 'topp'", "top_p" }, "typo")
t.raises(function() sample.rng(-1) end, { "seed must be a non-negative integer" }, "negative seed")

-- generation over a model: greedy equals a plain argmax loop over its
-- forwards; a seed repeats its text, another seed gives another; rows of a
-- batch are each their own draw; the window slides past block_size
do
  local cfg = { vocab_size = 37, n_layer = 1, n_head = 2, n_embd = 8, block_size = 6 }
  local m = nn.GPT(cfg):materialize { seed = 4 }
  local prompt = { 3, 14, 15 }
  local want = { 3, 14, 15 }
  fsdp.no_grad(function()
    for _ = 1, 7 do
      local from = math.max(1, #want - cfg.block_size + 1)
      local w = {}
      for i = from, #want do w[#w + 1] = want[i] end
      local l = m(fsdp.tensor({ w }, { dtype = "i64" })):narrow(2, #w, 1):contiguous():view(-1):tolist()
      local best = 1
      for v = 2, cfg.vocab_size do if l[v] > l[best] then best = v end end
      want[#want + 1] = best - 1
    end
  end)
  local got = m:generate({ prompt }, 7, { temperature = 0 })[1]
  t.eq(table.concat(got, ","), table.concat(want, ","), "greedy generation is the argmax loop (window slides)")
  local a = m:generate({ prompt, prompt, prompt }, 12, { seed = 5, temperature = 1.5, top_k = 0 })
  local b = m:generate({ prompt, prompt, prompt }, 12, { seed = 5, temperature = 1.5, top_k = 0 })
  local c = m:generate({ prompt, prompt, prompt }, 12, { seed = 6, temperature = 1.5, top_k = 0 })
  local function s(rows) local o = {} for i, r in ipairs(rows) do o[i] = table.concat(r, ",") end return table.concat(o, ";") end
  t.eq(s(a), s(b), "the same seed gives the same samples")
  t.ok(s(a) ~= s(c), "another seed gives other samples")
  t.ok(a[1][4] ~= a[2][4] or a[1][5] ~= a[2][5] or a[2][6] ~= a[3][6], "rows draw apart")
  t.eq(#a[3], 15, "prompt plus 12")
  local ok = true
  for _, r in ipairs(a) do for _, v in ipairs(r) do if v < 0 or v >= cfg.vocab_size then ok = false end end end
  t.ok(ok, "only ids of the vocabulary (the padded tail is never drawn)")
  t.eq(#m:generate(fsdp.tensor({ { 1, 2 } }, { dtype = "i64" }), 3)[1], 5, "a (1, T) tensor prompt")
  local mixed = m:generate({ { 1 }, { 2, 3, 4 } }, 2, { temperature = 0 })
  t.eq(#mixed[1] .. "," .. #mixed[2], "3,5", "rows of different lengths")
  t.raises(function() m:generate({ {} }, 2) end, { "prompt row 1 is empty" }, "an empty prompt")
  t.raises(function() m:generate({ { 1 } }, -1) end, { "n must be a non-negative integer" }, "negative n")
end

-- a sample's text stays text: stray bytes (a byte model's, a cut character) show as '?'
do
  local tok = require "fsdp.tokenizer"
  t.eq(tok.valid_utf8("a\195\169b\255c\226\130"), "a\195\169b?c??", "invalid UTF-8 bytes become '?'")
  t.eq(tok.valid_utf8("\224\128\128\237\160\128\240\159\152\128"), "??????\240\159\152\128",
    "overlong and surrogate forms are not characters; U+1F600 is")
  t.eq(table.concat(tok.encode_for(256, "Hi!"), ","), "72,105,33", "bytes for a vocabulary of 256")
  t.raises(function() tok.encode_for(1000, "x") end, { "no tokenizer for a vocabulary of 1000" }, "no tokenizer")
end

t.done()
