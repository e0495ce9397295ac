-- fsdp.sample: drawing tokens from a language model's logits, and the
-- generation loop around it.
--
--   local sample = require "fsdp.sample"
--   local rows = sample.generate(model, prompt, 64, { temperature = 0.8, top_k = 40, seed = 1 })
--   local p = sample.distribution(logits, { top_k = 40, top_p = 0.95, temperature = 0.8 })
--   local id = sample.draw(p, sample.rng(1):uniform())
--
-- The rule is the usual one (nanoGPT's sample.py, Hugging Face's
-- top_k_top_p_filtering): logits / temperature, keep the k largest
-- (top_k; with any equal to the k-th), of those the smallest prefix, most
-- likely first, whose probability reaches top_p, softmax over what is
-- kept, one draw. temperature = 0 or top_k = 1 is greedy (the largest
-- logit, the lowest id among equals). The draws come from a seeded
-- splitmix64 stream, so the same seed gives the same text on every rank
-- and every run; ranks see the same logits, so they pick the same tokens
-- and stay in step through the sharded forwards.

local bit = require "bit"

local M = {}

M.DEFAULTS = { temperature = 0.8, top_k = 40, top_p = 1.0 }

local Rng = {}
Rng.__index = Rng

--- sample.rng(seed) -> a stream of uniform numbers in [0, 1) (splitmix64;
-- 53 bits a draw), the same for the same integer seed everywhere.
function M.rng(seed)
  if type(seed) ~= "number" or seed ~= math.floor(seed) or seed < 0 then
    error("fsdp.sample.rng: seed must be a non-negative integer, got " .. tostring(seed), 2)
  end
  return setmetatable({ state = 0ULL + seed }, Rng)
end

--- r:next_u64() -> the next 64-bit output (uint64 cdata).
function Rng:next_u64()
  self.state = self.state + 0x9E3779B97F4A7C15ULL
  local z = self.state
  z = bit.bxor(z, bit.rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
  z = bit.bxor(z, bit.rshift(z, 27)) * 0x94D049BB133111EBULL
  return bit.bxor(z, bit.rshift(z, 31))
end

--- r:uniform() -> a number in [0, 1).
function Rng:uniform()
  return tonumber(bit.rshift(self:next_u64(), 11)) / 9007199254740992   -- 2^53
end

local function check_opts(opts, where, level)
  require("fsdp.options").check_keys(opts, { "temperature", "top_k", "top_p", "seed", "vocab_size", "block_size",
    "on_token" }, where, level + 1)
  local t, k, p = opts.temperature, opts.top_k, opts.top_p
  if t == nil then t = M.DEFAULTS.temperature end
  if k == nil then k = M.DEFAULTS.top_k end
  if p == nil then p = M.DEFAULTS.top_p end
  if type(t) ~= "number" or t < 0 or t ~= t then
    error(string.format("%s: temperature must be a number >= 0, got %s", where, tostring(t)), level + 1)
  end
  if type(k) ~= "number" or k < 0 or k ~= math.floor(k) then
    error(string.format("%s: top_k must be an integer >= 0 (0: off), got %s", where, tostring(k)), level + 1)
  end
  if type(p) ~= "number" or not (p > 0 and p <= 1) then
    error(string.format("%s: top_p must be in (0, 1] (1: off), got %s", where, tostring(p)), level + 1)
  end
  return t, k, p
end

-- The ids (0-based) of the k largest of logits[1..n], largest first, ties
-- to the lower id. k >= n: all of them, sorted.
local function top_ids(logits, n, k)
  local function before(a, b)
    local la, lb = logits[a + 1], logits[b + 1]
    if la ~= lb then return la > lb end
    return a < b
  end
  if k <= 0 or k >= n then
    local all = {}
    for v = 0, n - 1 do all[v + 1] = v end
    table.sort(all, before)
    return all
  end
  -- keep a sorted list of k; a value enters only when it beats the last
  local best = {}
  for v = 0, n - 1 do
    if #best < k or before(v, best[k]) then
      local i = math.min(#best, k - 1) + 1
      best[i] = v
      while i > 1 and before(best[i], best[i - 1]) do
        best[i], best[i - 1] = best[i - 1], best[i]
        i = i - 1
      end
    end
  end
  return best
end

-- top_ids, and after them every other id as large as the k-th (nanoGPT's
-- and Hugging Face's top-k keep those too).
local function top_k_with_ties(logits, n, k)
  local best = top_ids(logits, n, k)
  if k <= 0 or k >= n then return best end
  local edge, inside = logits[best[#best] + 1], {}
  for _, v in ipairs(best) do inside[v] = true end
  for v = 0, n - 1 do
    if logits[v + 1] == edge and not inside[v] then best[#best + 1] = v end
  end
  return best
end

--- sample.distribution(logits, opts) -> { ids = {...}, probs = {...} }:
-- the tokens a draw can pick (0-based ids, most likely first) and their
-- probabilities (summing to 1). logits: a Lua list, logits[v + 1] for id v;
-- opts: temperature (default 0.8), top_k (40; 0 = every id), top_p (1 =
-- off), vocab_size (default #logits: ids past it, a padded vocabulary,
-- never come out). A greedy setting gives one id of probability 1.
function M.distribution(logits, opts)
  opts = opts or {}
  local t, k, p = check_opts(opts, "fsdp.sample.distribution", 2)
  local n = opts.vocab_size or #logits
  if type(logits) ~= "table" or n < 1 or n > #logits then
    error(string.format("fsdp.sample.distribution: logits must be a list of at least vocab_size (%s) numbers, got %s",
      tostring(n), type(logits) == "table" and (#logits .. " values") or type(logits)), 2)
  end
  if t == 0 or k == 1 then return { ids = { top_ids(logits, n, 1)[1] }, probs = { 1 } } end
  local ids = top_k_with_ties(logits, n, k)
  local top, w, total = logits[ids[1] + 1], {}, 0
  for i, v in ipairs(ids) do
    w[i] = math.exp((logits[v + 1] - top) / t)
    total = total + w[i]
  end
  local kept = #ids
  if p < 1 then   -- the shortest prefix whose probability reaches top_p
    local cum = 0
    for i = 1, #ids do
      cum = cum + w[i] / total
      if cum >= p then kept = i; break end
    end
  end
  local out_ids, probs, sum = {}, {}, 0
  for i = 1, kept do sum = sum + w[i] end
  for i = 1, kept do out_ids[i], probs[i] = ids[i], w[i] / sum end
  return { ids = out_ids, probs = probs }
end

--- sample.draw(dist, u) -> the id that u (in [0, 1)) falls on when the
-- probabilities of dist (sample.distribution's) are laid end to end.
function M.draw(dist, u)
  local acc = 0
  for i, pr in ipairs(dist.probs) do
    acc = acc + pr
    if u < acc then return dist.ids[i] end
  end
  return dist.ids[#dist.ids]   -- u within rounding of 1
end

local function rows_of(prompt, where)
  local rows = prompt
  if type(prompt) ~= "table" then
    local ok, list = pcall(function() return prompt:tolist() end)
    if not ok or type(list) ~= "table" or type(list[1]) ~= "table" then
      error(where .. ": prompt must be a (B, T) tensor of token ids or a list of lists of ids", 3)
    end
    rows = list
  else
    local copy = {}
    for b, r in ipairs(prompt) do
      if type(r) ~= "table" then error(where .. ": prompt must be a list of lists of token ids", 3) end
      copy[b] = {}
      for i, v in ipairs(r) do copy[b][i] = v end
    end
    rows = copy
  end
  if #rows == 0 then error(where .. ": prompt has no rows", 3) end
  for b, r in ipairs(rows) do
    if #r == 0 then error(string.format("%s: prompt row %d is empty (a model needs at least one token)", where, b), 3) end
  end
  return rows
end

--- sample.generate(model, prompt, n, opts) -> rows: the prompt's rows (a
-- (B, T) tensor of ids, or Lua lists) each followed by n generated ids, as
-- Lua lists. model(idx) must give logits (B, T, V). Rows of the same length
-- go through the model together. opts: those of sample.distribution, seed
-- (default 1), block_size (default model.config.block_size: the window of
-- the newest tokens the model sees), vocab_size (default model.vocab_size),
-- on_token(i, n) called after each generated position (progress).
-- Under fsdp.shard every rank must call it alike: each forward gathers.
function M.generate(model, prompt, n, opts)
  opts = opts or {}
  local where = (model and model.__name or "fsdp.sample") .. ":generate"
  check_opts(opts, where, 2)
  if type(n) ~= "number" or n < 0 or n ~= math.floor(n) then
    error(string.format("%s: n must be a non-negative integer, got %s", where, tostring(n)), 2)
  end
  local fsdp = require "fsdp"
  local rows = rows_of(prompt, where)
  local block = opts.block_size or (model.config and model.config.block_size) or math.huge
  local vocab = opts.vocab_size or model.vocab_size
  local rng = M.rng(opts.seed or 1)
  local dopts = { temperature = opts.temperature, top_k = opts.top_k, top_p = opts.top_p, vocab_size = vocab }
  -- rows grouped by length: each group is one forward per token
  local groups, by_len = {}, {}
  for b, r in ipairs(rows) do
    local g = by_len[#r]
    if not g then g = {}; by_len[#r] = g; groups[#groups + 1] = g end
    g[#g + 1] = b
  end
  local was_training = model.training
  if model.eval then model:eval() end
  fsdp.no_grad(function()
    for step = 1, n do
      for _, g in ipairs(groups) do
        local len = #rows[g[1]]
        local from = math.max(1, len - block + 1)
        local window = {}
        for j, b in ipairs(g) do
          local w = {}
          for i = from, len do w[#w + 1] = rows[b][i] end
          window[j] = w
        end
        local T = len - from + 1
        local logits = model(fsdp.tensor(window, { dtype = "i64" }))
        local V = logits:shape()[3]
        local last = logits:narrow(2, T, 1):contiguous():view(#g, V):tolist()
        logits:free()
        for j, b in ipairs(g) do
          local d = M.distribution(last[j], { temperature = dopts.temperature, top_k = dopts.top_k,
            top_p = dopts.top_p, vocab_size = dopts.vocab_size or V })
          local r = rows[b]
          r[#r + 1] = M.draw(d, rng:uniform())
        end
      end
      if opts.on_token then opts.on_token(step, n) end
    end
  end)
  if model.train then model:train(was_training) end
  return rows
end

--- sample.describe(opts) -> the sampler in words: "greedy", or e.g.
-- "temperature 0.8, top-k 40" (with ", top-p 0.9" when top_p < 1).
function M.describe(opts)
  local t, k, p = check_opts(opts or {}, "fsdp.sample.describe", 2)
  if t == 0 or k == 1 then return "greedy" end
  local s = string.format("temperature %g, top-k %s", t, k == 0 and "off" or tostring(k))
  if p < 1 then s = s .. string.format(", top-p %g", p) end
  return s
end

--- sample.text(row, prompt_len, vocab_size, title) -> the lines that show
-- one sample: title, then the prompt and the continuation each on a line
-- of its own (decoded by tokenizer.printable; ids when nothing decodes).
function M.text(row, prompt_len, vocab_size, title)
  local printable = require("fsdp.tokenizer").printable
  local head, tail = {}, {}
  for i, v in ipairs(row) do
    if i <= prompt_len then head[#head + 1] = v else tail[#tail + 1] = v end
  end
  local p = printable(head, vocab_size)
  local c = printable(tail, vocab_size)
  return string.format("%s\n  prompt       | %s\n  continuation | %s", title, p, c)
end

return M
