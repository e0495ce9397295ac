-- nn modules beyond the PyTorch golden test: deterministic init, module
-- bookkeeping, the Llama variant's rotary embedding against a plain-Lua
-- reference, activation checkpointing (same numbers, less memory), HF
-- round trips, generation, optimizers and schedules.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local st = require "fsdp.safetensors"

local cfg = { vocab_size = 100, n_layer = 2, n_head = 2, n_embd = 16, block_size = 12 }
local function ids(B, T, seed)
  local rows, x = {}, seed or 1
  for b = 1, B do
    rows[b] = {}
    for i = 1, T do
      x = (x * 48271) % 2147483647
      rows[b][i] = x % cfg.vocab_size
    end
  end
  return fsdp.tensor(rows, { dtype = "i64" })
end
local function flat(x) return x:float():contiguous():view(-1):tolist() end
local function max_diff(a, b)
  local x, y, m = flat(a), flat(b), 0
  for i = 1, #x do m = math.max(m, math.abs(x[i] - y[i])) end
  return m
end

-- ---- init depends only on (seed, path, index) ----
do
  local a = nn.GPT(cfg):materialize { seed = 3 }
  local b = nn.GPT(cfg):materialize { seed = 3 }
  local c = nn.GPT(cfg):materialize { seed = 4 }
  local deeper = nn.GPT({ vocab_size = 100, n_layer = 3, n_head = 2, n_embd = 16, block_size = 12 })
      :materialize { seed = 3 }
  local sa, sb, sc, sd = a:state_dict(), b:state_dict(), c:state_dict(), deeper:state_dict()
  t.eq(max_diff(sa["h.1.mlp.c_fc.weight"], sb["h.1.mlp.c_fc.weight"]), 0, "same seed, same values")
  t.ok(max_diff(sa["h.1.mlp.c_fc.weight"], sc["h.1.mlp.c_fc.weight"]) > 0, "another seed, other values")
  t.eq(max_diff(sa["h.1.attn.c_attn.weight"], sd["h.1.attn.c_attn.weight"]), 0,
    "a parameter's values do not depend on the rest of the model")
  t.ok(max_diff(sa["h.0.mlp.c_fc.weight"], sa["h.1.mlp.c_fc.weight"]) > 0, "paths give distinct streams")
  -- GPT-2 init: std 0.02, residual projections 0.02/sqrt(2L), LayerNorm ones, biases zero
  local function std(x)
    local v, s, s2 = flat(x), 0, 0
    for i = 1, #v do s, s2 = s + v[i], s2 + v[i] ^ 2 end
    return math.sqrt(s2 / #v - (s / #v) ^ 2)
  end
  local big = nn.GPT({ vocab_size = 512, n_layer = 2, n_head = 2, n_embd = 128, block_size = 8 }):materialize { seed = 1 }
  local sbig = big:state_dict()
  t.near(std(sbig["wte.weight"]), 0.02, 0.02, "wte std 0.02")
  t.near(std(sbig["h.0.attn.c_proj.weight"]), 0.02 / math.sqrt(4), 0.03, "residual projection std 0.02/sqrt(2L)")
  t.eq(sbig["h.0.ln_1.weight"]:mean():item(), 1, "LayerNorm weight ones")
  t.eq(sbig["h.0.mlp.c_fc.bias"]:float():sum():item(), 0, "biases zero")
end

-- ---- module bookkeeping ----
do
  local m = nn.GPT(cfg)
  local names = {}
  for _, p in ipairs(m:named_parameters()) do names[#names + 1] = p.path end
  t.eq(names[1], "wte.weight", "first parameter path")
  t.eq(names[3], "h.0.ln_1.weight", "block parameter path")
  t.eq(#names, 4 + 12 * cfg.n_layer, "parameter count by tensors")
  t.eq(m:num_parameters(), 128 * 16 + 12 * 16 + 2 * (12 * 16 * 16 + 13 * 16) + 2 * 16,
    "parameter count by elements (padded vocabulary 128)")
  t.raises(function() m:parameters() end, { "not materialized" }, "parameters() before materialize")
  m:materialize { seed = 1 }
  local sd = m:state_dict()
  local other = nn.GPT(cfg)
  t.raises(function() other:load_state_dict({ ["wte.weight"] = sd["wte.weight"] }) end, { "missing" },
    "load_state_dict: a missing name")
  local bad = {}
  for k, v in pairs(sd) do bad[k] = v end
  bad["ln_f.weight"] = fsdp.zeros(17)
  t.raises(function() other:load_state_dict(bad) end, { "ln_f.weight", "(17)", "(16)" }, "load_state_dict: a shape")
  bad["ln_f.weight"], bad["extra.weight"] = sd["ln_f.weight"], fsdp.zeros(1)
  t.raises(function() other:load_state_dict(bad) end, { "unexpected 'extra.weight'" }, "load_state_dict: unknown name")
  t.raises(function() nn.GPT({ vocab_size = 0, n_layer = 1, n_head = 1, n_embd = 4, block_size = 4 }) end,
    { "vocab_size" }, "bad config")
  t.raises(function() m(ids(1, 13)) end, { "context 13", "block_size 12" }, "context longer than the model's")
  m:eval()
  t.eq(m.h:get(0).attn.training, false, "eval reaches every module")
  m:train()
  t.eq(m.h:get(1).mlp.c_fc.training, true, "train reaches every module")
  local d = nn.Dropout(0.5)
  local x = fsdp.randn(4, 8, { seed = 2 })
  d:eval()
  t.eq(max_diff(d(x), x), 0, "Dropout is the identity in eval mode")
  d:train()
  local y = d(x):tolist()
  local zeros = 0
  for _, row in ipairs(y) do for _, v in ipairs(row) do if v == 0 then zeros = zeros + 1 end end end
  t.ok(zeros > 4 and zeros < 28, "Dropout zeroes about half in training (" .. zeros .. " of 32)")
  t.raises(function() nn.Dropout(1) end, { "[0, 1)" }, "Dropout p = 1")
end

-- ---- rotary embedding against plain Lua ----
do
  local attn = nn.CausalSelfAttention(8, 2, { rotary = true, block_size = 6, bias = false })
  local x = fsdp.randn(1, 2, 5, 4, { seed = 9 })            -- (B, H, T, D)
  local got = attn:rope(x, 5):tolist()
  local xv = x:tolist()
  local worst = 0
  for h = 1, 2 do
    for pos = 1, 5 do
      for j = 1, 4 do
        local half = 2
        local jj = (j - 1) % half
        local freq = 10000 ^ (-2 * jj / 4)
        local angle = (pos - 1) * freq
        local rot = j <= half and -xv[1][h][pos][j + half] or xv[1][h][pos][j - half]
        local want = xv[1][h][pos][j] * math.cos(angle) + rot * math.sin(angle)
        worst = math.max(worst, math.abs(got[1][h][pos][j] - want))
      end
    end
  end
  t.ok(worst < 1e-5, string.format("rotary embedding matches the formula (max error %.2g)", worst))
  -- a rotation keeps each position's norm
  local llama = nn.Llama({ vocab_size = 100, n_layer = 2, n_head = 2, n_embd = 16, block_size = 12 })
      :materialize { seed = 5 }
  local opt = optim.AdamW(llama:parameters(), { lr = 1e-2, weight_decay = 0 })
  local x2, y2 = ids(2, 12, 3), ids(2, 12, 4)
  local first, last
  for step = 1, 8 do
    local _, loss = llama(x2, y2)
    loss:backward()
    opt:step()
    opt:zero_grad()
    first = first or loss:item()
    last = loss:item()
  end
  t.ok(last < first - 0.5, string.format("Llama trains: loss %.3f -> %.3f", first, last))
  t.eq(llama.lm_head.weight:shape()[1], 128, "Llama's untied head covers the padded vocabulary")
end

-- ---- activation recomputation: same numbers, less activation memory ----
do
  local big = { vocab_size = 100, n_layer = 4, n_head = 2, n_embd = 64, block_size = 64 }
  local x, y = ids(4, 64, 11), ids(4, 64, 12)
  local function run(checkpointed)
    local m = nn.GPT(big):materialize { seed = 8 }
    if checkpointed then nn.recompute(m, "Block") end
    collectgarbage()
    fsdp.memory.reset_peak()
    local base = fsdp.memory.stats("activation").current
    local _, loss = m(x, y)
    loss:backward()
    local peak = fsdp.memory.stats("activation").peak - base
    local grads = {}
    for _, p in ipairs(m:named_parameters()) do grads[p.path] = p.tensor:get_grad() end
    return loss:item(), grads, peak
  end
  local l1, g1, peak1 = run(false)
  local l2, g2, peak2 = run(true)
  t.eq(l2, l1, "checkpointed loss is identical")
  local worst = 0
  for k, g in pairs(g1) do worst = math.max(worst, max_diff(g, g2[k])) end
  t.eq(worst, 0, "checkpointed gradients are identical")
  t.ok(peak2 < 0.8 * peak1, string.format("activation peak %.2f MiB checkpointed vs %.2f MiB plain",
    peak2 / 2 ^ 20, peak1 / 2 ^ 20))
end

-- ---- HF names: export, reload, same logits ----
do
  local m = nn.GPT(cfg):materialize { seed = 6 }
  local hf = m:to_hf()
  t.eq(hf["wte.weight"]:shape()[1], 100, "export cuts the padded vocabulary")
  t.eq(hf["h.0.attn.c_attn.weight"]:shape()[1], 16, "Conv1D layout: (in, out)")
  local path = os.tmpname()
  st.save(path, hf, { format = "pt" })
  local back = nn.GPT(cfg)
  back:from_hf(st.load(path))
  os.remove(path)
  local x = ids(2, 12, 5)
  -- the padded vocabulary rows are not exported (the import zeroes them)
  t.eq(max_diff(m(x):narrow(3, 1, 100), back(x):narrow(3, 1, 100)), 0, "logits after an HF round trip")
  local bad = st.load((function()
    local p = os.tmpname()
    st.save(p, { ["wte.weight"] = fsdp.zeros(99, 16) })
    return p
  end)())
  t.raises(function() nn.GPT(cfg):from_hf(bad) end, { "wte.weight has 99 rows", "vocab_size is 100" },
    "from_hf with a wrong vocabulary")
end

-- ---- generation ----
do
  local m = nn.GPT(cfg):materialize { seed = 2 }
  local prompt = ids(1, 4, 7)
  local a = m:generate(prompt, 6, { temperature = 0 })
  local b = m:generate(prompt, 6, { temperature = 0 })
  t.eq(table.concat(a[1], ","), table.concat(b[1], ","), "greedy generation is deterministic")
  t.eq(#a[1], 10, "prompt plus 6 tokens")
  local s1 = m:generate(prompt, 20, { top_k = 5, seed = 3 })
  local s2 = m:generate(prompt, 20, { top_k = 5, seed = 3 })
  t.eq(table.concat(s1[1], ","), table.concat(s2[1], ","), "top-k sampling repeats with its seed")
  local ok = true
  for _, v in ipairs(s1[1]) do if v >= cfg.vocab_size then ok = false end end
  t.ok(ok, "padded vocabulary ids are never sampled")
end

-- ---- optimizers and schedules ----
do
  local w = fsdp.tensor({ 3, -2 }, { requires_grad = true })
  local opt = optim.SGD({ w }, { lr = 0.1, momentum = 0.9 })
  for _ = 1, 50 do
    local loss = (w * w):sum()
    loss:backward()
    opt:step()
    opt:zero_grad()
  end
  local v = w:tolist()
  t.ok(math.abs(v[1]) < 0.2 and math.abs(v[2]) < 0.2, "SGD with momentum minimizes a quadratic")
  t.raises(function() optim.SGD({ w }, {}) end, { "lr is required" }, "SGD without lr")
  local cos = optim.schedule.cosine(1.0, 10, 110, 0.1)
  t.near(cos(5), 0.5, 1e-12, "warmup is linear")
  t.near(cos(10), 1.0, 1e-12, "peak after warmup")
  t.near(cos(60), 0.55, 1e-12, "cosine midpoint")
  t.near(cos(110), 0.1, 1e-12, "minimum at the end")
  local lin = optim.schedule.linear(1.0, 0, 100, 0)
  t.near(lin(50), 0.5, 1e-12, "linear decay")
  -- clipping scales to the max norm
  local g = fsdp.tensor({ 3, 4 }, { requires_grad = true })
  local loss = (g * fsdp.tensor({ 3, 4 })):sum()
  loss:backward()
  local norm = optim.clip_grad_norm({ g }, 1.0)
  t.near(norm, 5, 1e-6, "norm before clipping")
  t.all_near(g:get_grad():tolist(), { 0.6, 0.8 }, 1e-6, "clipped to norm 1")
end

-- ---- the clip folded into the optimizer: step { grad_scale = clip_coef(norm, max) } ----
do
  t.eq(optim.clip_coef(5, 1), 1 / (5 + 1e-6), "clip_coef: max_norm / (norm + 1e-6) below 1")
  t.eq(optim.clip_coef(0.5, 1), 1, "clip_coef: 1 when the norm is within max_norm")
  t.eq(optim.clip_coef(0 / 0, 1), 1, "clip_coef: a NaN norm scales nothing (as clip_grad_norm)")
  t.raises(function() optim.clip_coef(1, -1) end, { "clip_coef", "max_norm >= 0" }, "clip_coef with a negative max")
  t.raises(function() optim.clip_coef("1", 1) end, { "clip_coef", "string" }, "clip_coef of a string")
  -- two copies of the same parameters and gradients (prime sizes, above the
  -- 16-lane width and its tail): clipped then stepped, and stepped with the
  -- coefficient; the parameters agree bit for bit over three steps
  local function params(seed)
    local ps = {}
    for i, n in ipairs({ 37, 1, 211 }) do
      ps[i] = fsdp.randn({ n }, { seed = seed + i, requires_grad = true })
    end
    return ps
  end
  local function set_grads(ps, step)
    for i, p in ipairs(ps) do p:set_grad(fsdp.randn(p:shape(), { seed = 100 * step + i }) * (4 * step)) end
  end
  for _, kind in ipairs({ "AdamW", "SGD" }) do
    local make = function(ps)
      if kind == "AdamW" then return optim.AdamW(ps, { lr = 1e-2, weight_decay = 0.1 }) end
      return optim.SGD(ps, { lr = 0.1, momentum = 0.9, weight_decay = 0.01 })
    end
    local a, b = params(1), params(1)
    local oa, ob = make(a), make(b)
    local kept = true
    for step = 1, 3 do
      set_grads(a, step)
      set_grads(b, step)
      local norm = optim.clip_grad_norm(a, 1.0)
      oa:step()
      local before = b[3]:get_grad():tolist()
      ob:step { grad_scale = optim.clip_coef(optim.grad_norm(b), 1.0) }
      t.ok(norm > 1, kind .. " step " .. step .. ": the gradients are clipped (norm " .. norm .. ")")
      if kind == "AdamW" then
        local after = b[3]:get_grad():tolist()
        for i = 1, #before do kept = kept and before[i] == after[i] end
      end
      oa:zero_grad()
      ob:zero_grad()
    end
    local worst = 0
    for i = 1, #a do worst = math.max(worst, max_diff(a[i], b[i])) end
    t.eq(worst, 0, kind .. ": step { grad_scale } equals clip_grad_norm then step, bit for bit")
    if kind == "AdamW" then t.ok(kept, "AdamW reads the gradients scaled and leaves them as they are") end
    for _, bad in ipairs({ -1, 1 / 0, 0 / 0, "0.5" }) do
      t.raises(function() ob:step { grad_scale = bad } end,
        { kind .. ":step: grad_scale must be a finite number >= 0", tostring(bad) }, kind .. " grad_scale " .. tostring(bad))
    end
    t.raises(function() ob:step { gradscale = 0.5 } end, { kind .. ":step: unknown option 'gradscale'", "grad_scale" },
      kind .. " step option typo")
    t.raises(function() ob:step(0.5) end, { kind .. ":step: expected an options table, got number" },
      kind .. " step with a number")
  end
end


-- ---- a misspelled option or config key is an error naming the closest one ----
t.raises(function() return nn.Linear(2, 3, { bais = false }) end, { "Linear: unknown option 'bais'",
  "did you mean 'bias'?" }, "Linear option typo")
t.raises(function() return nn.LayerNorm(4, { esp = 1e-5 }) end, { "LayerNorm: unknown option 'esp'",
  "did you mean 'eps'?" }, "LayerNorm option typo")
t.raises(function() return nn.Block(8, 2, { nrom = "rmsnorm" }) end, { "Block: unknown option 'nrom'",
  "did you mean 'norm'?" }, "Block option typo")
t.raises(function()
  return nn.GPT({ vocab_size = 16, n_layers = 2, n_layer = 1, n_head = 1, n_embd = 8, block_size = 4 })
end, { "GPT config: unknown option 'n_layers'", "did you mean 'n_layer'?" }, "GPT config typo")
t.raises(function()
  local m = nn.GPT(nn.gpt_preset("tiny")):materialize { seed = 1 }
  return m:generate(fsdp.tensor({ { 1, 2 } }, { dtype = "i64" }), 1, { topk = 3 })
end, { "GPT:generate: unknown option 'topk'", "did you mean 'top_k'?" }, "generate option typo")
t.raises(function() return nn.gpt_preset("huge") end, { "no preset 'huge'", "tiny, small" }, "unknown preset")
t.eq(nn.gpt_preset("small").n_embd, 768, "the small preset is GPT-2 124M's width")

-- ---- activation modules, Sequential, mse_loss (values worked by hand) ----
do
  local x = fsdp.tensor({ -2, -0.5, 0, 0.25, 3 }, { requires_grad = true })
  t.all_near(flat(nn.ReLU()(x)), { 0, 0, 0, 0.25, 3 }, 0, "ReLU: max(x, 0)")
  local y = fsdp.relu(x)
  y:sum():backward()
  t.all_near(flat(x.grad), { 0, 0, 0, 1, 1 }, 0, "ReLU's gradient: 1 where x > 0, else 0 (0 at 0, as PyTorch)")
  local r = flat(fsdp.relu(fsdp.tensor({ 0 / 0, -1 })))
  t.ok(r[1] ~= r[1] and r[2] == 0, "ReLU keeps a NaN a NaN")
  t.near(flat(nn.GELU()(fsdp.tensor({ 1 })))[1], 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * (1 + 0.044715))), 1e-6,
    "GELU module: the tanh form")
  t.near(flat(nn.SiLU()(fsdp.tensor({ 2 })))[1], 2 / (1 + math.exp(-2)), 1e-6, "SiLU module: x sigmoid(x)")
  -- Sequential: Linear(2, 2) with weight [[1, -1], [2, 0]], bias [0, -3], then ReLU, then Linear(2, 1) [[1, 1]]
  local seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1, { bias = false }))
  seq:materialize()
  seq["0"].weight:copy(fsdp.tensor({ { 1, -1 }, { 2, 0 } }))
  seq["0"].bias:copy(fsdp.tensor({ 0, -3 }))
  seq["2"].weight:copy(fsdp.tensor({ { 1, 1 } }))
  local out = seq(fsdp.tensor({ { 3, 1 }, { 1, 2 } }))
  -- row 1: [2, 3] -> [2, 3] -> 5; row 2: [-1, -1] -> [0, 0] -> 0
  t.all_near(flat(out), { 5, 0 }, 1e-6, "Sequential runs its modules in order")
  t.eq(seq:num_parameters(), 2 * 2 + 2 + 2, "Sequential's parameters are its children's")
  t.ok(tostring(seq):find("0: Linear", 1, true) and tostring(seq):find("1: ReLU", 1, true), "Sequential prints its children")
  t.raises(function() return nn.Sequential(nn.ReLU(), 3) end, { "Sequential: argument 2 is a number, not a module" },
    "Sequential refuses a non-module")
  t.near(flat(fsdp.mse_loss(fsdp.tensor({ 1, 2, 4 }), fsdp.tensor({ 1, 1, 1 })))[1], (0 + 1 + 9) / 3, 1e-6,
    "mse_loss: the mean of the squared differences")
end

t.done()
