-- Tests for fsdp.tokenizer: GPT-2's BPE against reference tokenizations made
-- by the npm package gpt-3-encoder under node and GPT-2's rule under Python
-- regex (tests/fixtures/gpt2_tokens.json, see tools/dev/make_tokenizer_fixture.py),
-- exact round trips of any bytes, errors, and make_shards --tokenizer=gpt2.

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local ffi = require "ffi"
local json = require "fsdp.json"
local data = require "fsdp.data"
local tokenizer = require "fsdp.tokenizer"

local root = (arg and arg[0] and arg[0]:match("^(.*/)tests/lua/")) or "./"
local tmp = os.tmpname()
os.remove(tmp)
assert(os.execute("mkdir -p '" .. tmp .. "'"))
local function P(name) return tmp .. "/" .. name end
local function write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
  return path
end
local function same(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end
local function first_diff(a, b)
  for i = 1, math.max(#a, #b) do
    if a[i] ~= b[i] then return string.format("at %d: got %s, want %s", i, tostring(a[i]), tostring(b[i])) end
  end
end

-- The shipped copy is found without being told where.
local tok = tokenizer.gpt2()
t.eq(tok.vocab_size, 50257, "vocabulary size")
t.eq(tok.num_merges, 50000, "merge count")
t.eq(tok.eot, 50256, "<|endoftext|> id")
t.ok(same(tok:encode("Hello world"), { 15496, 995 }), "Hello world")
t.eq(tok:decode({ 15496, 995 }), "Hello world", "decode Hello world")

-- ---- the reference tokenizations ----
local f = assert(io.open(root .. "tests/fixtures/gpt2_tokens.json", "rb"))
local fixture = json.decode(f:read("*a"))
f:close()
local cases = fixture.cases
t.ok(#cases >= 300, "fixture holds the cases")
local pieces_ok, tokens_ok, with_tokens, round_ok, total = 0, 0, 0, 0, 0
for i, c in ipairs(cases) do
  local p = tokenizer.pretokenize(c.text)
  if same(p, c.pieces) then pieces_ok = pieces_ok + 1
  else t.ok(false, string.format("case %d pieces %q: %s", i, c.text, first_diff(p, c.pieces))) end
  local ids = tok:encode(c.text)
  if c.tokens then
    with_tokens = with_tokens + 1
    if same(ids, c.tokens) then tokens_ok = tokens_ok + 1
    else t.ok(false, string.format("case %d tokens %q: %s", i, c.text, first_diff(ids, c.tokens))) end
  end
  if tok:decode(ids) == c.text then round_ok = round_ok + 1
  else t.ok(false, string.format("case %d round trip %q", i, c.text)) end
  total = total + #ids
end
t.eq(pieces_ok, #cases, "every case pre-tokenizes as GPT-2's rule does")
t.ok(with_tokens >= #cases - 3, "most cases carry reference tokens")
t.eq(tokens_ok, with_tokens, "every case tokenizes as the reference, token for token")
t.eq(round_ok, #cases, "decode(encode(text)) == text on every case")
t.ok(total > 10000, "the fixture exercises many tokens")

-- encode_buffer gives the same ids as encode, also when it has to grow.
do
  local text = ""
  for i = 1, 40 do text = text .. cases[i].text end
  local list = tok:encode(text)
  local buf, n = tok:encode_buffer(text)
  local got = {}
  for i = 0, n - 1 do got[i + 1] = buf[i] end
  t.ok(same(got, list), "encode_buffer matches encode")
  local small, m = tok:encode_buffer("a b c d e f g h i j k l m n o p q r s t u v w x y z " .. ("!? "):rep(50))
  t.eq(tok:decode(small, m), "a b c d e f g h i j k l m n o p q r s t u v w x y z " .. ("!? "):rep(50),
       "encode_buffer grows and decodes back")
end

-- ---- any bytes round-trip exactly (invalid UTF-8 is 'other') ----
t.ok(same(tokenizer.pretokenize("a\255b"), { "a", "\255", "b" }), "a lone invalid byte is one 'other' piece")
t.ok(same(tokenizer.pretokenize("x \192\175!"), { "x", " \192\175!" }), "overlong bytes join 'other' characters")
t.ok(same(tokenizer.pretokenize("ab\230\151"), { "ab", "\230\151" }), "a cut-short sequence at the end")
t.ok(same(tokenizer.pretokenize("\237\160\128z"), { "\237\160\128", "z" }), "an encoded surrogate is not a letter")
do
  local seed = 12345
  local function rnd(n) seed = (seed * 48271) % 2147483647; return seed % n end
  local bad = 0
  for _ = 1, 200 do
    local parts = {}
    for k = 1, 1 + rnd(50) do parts[k] = string.char(rnd(256)) end
    local s = table.concat(parts)
    if tok:decode(tok:encode(s)) ~= s then bad = bad + 1 end
  end
  t.eq(bad, 0, "random byte strings round-trip")
end
do  -- every single byte, and the pieces of a text concatenate back to it
  local bad = 0
  for b = 0, 255 do
    local ids = tok:encode(string.char(b))
    if #ids ~= 1 or tok:decode(ids) ~= string.char(b) then bad = bad + 1 end
  end
  t.eq(bad, 0, "each byte is one token and decodes to itself")
  t.eq(table.concat(tokenizer.pretokenize(cases[2].text)), cases[2].text, "pieces cover the text")
end

-- ---- errors ----
t.raises(function() tok:decode({ 15496, 50257 }) end, { "token 50257", "position 2", "50257" }, "decode: id past the vocabulary")
t.raises(function() tok:decode({ -1 }) end, { "token -1" }, "decode: negative id")
t.raises(function() tok:encode(42) end, { "text must be a string" }, "encode: not a string")
t.raises(function() tokenizer.gpt2(P("nowhere")) end, { "cannot open encoder", "nowhere/encoder.json" }, "missing folder")
t.raises(function() tokenizer.gpt2(7) end, { "folder (string)" }, "bad argument")
do
  local dir = P("bad")
  assert(os.execute("mkdir -p '" .. dir .. "'"))
  write(dir .. "/encoder.json", "[1, 2]")
  write(dir .. "/vocab.bpe", "#version: 0.2\n")
  t.raises(function() tokenizer.gpt2(dir) end, { "not a JSON object", dir .. "/encoder.json" }, "encoder not an object")
  write(dir .. "/encoder.json", "{\"a\": ")
  t.raises(function() tokenizer.gpt2(dir) end, { "not a JSON object", "encoder.json" }, "encoder truncated")
  -- a real encoder with a corrupt merge line
  local ef = assert(io.open(root .. "data/gpt2/encoder.json", "rb"))
  write(dir .. "/encoder.json", ef:read("*a"))
  ef:close()
  write(dir .. "/vocab.bpe", "#version: 0.2\n\196\160 t\nnot-a-pair\n")
  t.raises(function() tokenizer.gpt2(dir) end, { "vocab.bpe' line 3", "not-a-pair" }, "vocab: bad line names it")
  write(dir .. "/vocab.bpe", "#version: 0.2\n")
  t.raises(function() tokenizer.gpt2(dir) end, { "holds no merges" }, "vocab: empty")
  t.raises(function() tokenizer.gpt2 { encoder = dir .. "/encoder.json" } end, { "vocab =" }, "table without vocab")
end

-- ---- make_shards --tokenizer=gpt2 ----
do
  local launcher = os.getenv("FSDP_TEST_LAUNCHER") or (arg and arg[-1])
  local tool = root .. "tools/make_shards.lua"
  local text = cases[2].text .. "\n" .. cases[19].text .. "\n\n" .. cases[22].text
  local input = write(P("in.txt"), text)
  local out = P("shards")
  local p = io.popen(string.format("'%s' '%s' --input='%s' --out='%s' --tokenizer=gpt2 --val-fraction=0.25 --shard-tokens=20 2>&1",
                                   launcher, tool, input, out))
  local log = p:read("*a")
  p:close()
  t.ok(log:find("gpt2, vocab 50257", 1, true) ~= nil, "make_shards reports the tokenizer")
  local all, nval = {}, 0
  for _, split in ipairs { "train", "val" } do
    for _, path in ipairs(data.glob(out .. "/" .. split .. "_*.bin")) do
      local toks, n = data.read_shard(path)
      t.ok(n <= 20, "make_shards gpt2: shard-tokens respected")
      for i = 0, n - 1 do all[#all + 1] = toks[i] end
      if split == "val" then nval = nval + n end
    end
  end
  local want = tok:encode(text)
  table.insert(want, 1, tok.eot)
  t.ok(same(all, want), "make_shards gpt2: <|endoftext|> then the text's tokens, train then val")
  t.eq(nval, math.floor(#want * 0.25 + 0.5), "make_shards gpt2: val is the last fraction of the tokens")
  local p2 = io.popen(string.format("'%s' '%s' --input='%s' --out='%s' --tokenizer=gpt5 2>&1; echo rc=$?",
                                    launcher, tool, input, out))
  local log2 = p2:read("*a")
  p2:close()
  t.ok(log2:find("--tokenizer expects one of bytes, gpt2, got 'gpt5'", 1, true) and log2:find("rc=2", 1, true), "make_shards: bad tokenizer")
end

os.execute("rm -rf '" .. tmp .. "'")
-- The merge loop against GPT-2's own (each pass rescans every pair, merges
-- every occurrence of the best one left to right): the same ids on seeded
-- random pieces of letters, digits, spaces, marks and multi-byte characters.
local function reference_encode(text)
  local out = {}
  for _, piece in ipairs(tokenizer.pretokenize(text)) do
    local word, n = {}, #piece
    for i = 1, n do word[i] = tok._byte_id[piece:byte(i)] end
    while n > 1 do
      local best, at = math.huge, 0
      for k = 1, n - 1 do
        local rk = tok._rank[word[k] * 65536 + word[k + 1]]
        if rk and rk < best then best, at = rk, k end
      end
      if at == 0 then break end
      local a, b = word[at], word[at + 1]
      local m = tok._merged[a * 65536 + b]
      local merged_word, o, k = {}, 0, 1
      while k <= n do
        if k < n and word[k] == a and word[k + 1] == b then
          o = o + 1; merged_word[o] = m; k = k + 2
        else
          o = o + 1; merged_word[o] = word[k]; k = k + 1
        end
      end
      word, n = merged_word, o
    end
    for k = 1, n do out[#out + 1] = word[k] end
  end
  return out
end
do
  local heap_tok = tokenizer.gpt2()
  heap_tok._short_piece = 1   -- every piece of two bytes or more through the heap loop
  local seed = 23
  local function rnd(m) seed = (seed * 1103515245 + 12345) % 2147483648; return seed % m + 1 end
  local parts = { "a", "b", "e", "t", "h", "q", "z", " ", "  ", "\n", "0", "1", "7", "\195\169", "\195\188",
                  "!", "'s", "ing", "the", "aaa", "ll", "\226\128\148", "\240\159\152\128", "\255", "ABC" }
  local differ, first = 0, nil
  for case = 1, 2000 do
    local bits = {}
    for i = 1, rnd(60) do bits[i] = parts[rnd(#parts)] end
    local text = table.concat(bits)
    if not (same(heap_tok:encode(text), reference_encode(text)) and same(tok:encode(text), reference_encode(text))) then
      differ = differ + 1
      first = first or text
    end
  end
  t.eq(differ, 0, "2000 seeded texts: the same ids as GPT-2's merge loop" .. (first and (" (first: %q)"):format(first) or ""))
  local f = assert(io.open(root .. "data/corpus.txt", "rb"))
  local corpus = f:read("*a")
  f:close()
  t.ok(#corpus > 10000 and same(heap_tok:encode(corpus), reference_encode(corpus)), "data/corpus.txt: the same ids as GPT-2's merge loop")

  -- One pre-token of 200 KB of letters. Repeating "abcdefghij" needs few
  -- passes of GPT-2's loop, so its ids are quick to get; seeded random letters
  -- need a pass per merge (tens of seconds there, a fraction of one here):
  -- those round trip, and match the reference on a 3 KB prefix.
  local long = string.rep("abcdefghij", 20480)
  local got = tok:encode(long)
  t.ok(same(got, reference_encode(long)), "200 KB pre-token (repeating): the same ids as GPT-2's merge loop")
  t.eq(#tokenizer.pretokenize(long), 1, "200 KB of letters is one pre-token")
  local letters = {}
  for i = 1, 204800 do letters[i] = string.char(96 + rnd(26)) end
  local random_long = table.concat(letters)
  local ids = tok:encode(random_long)
  t.ok(#ids > 50000 and #ids < 204800, "200 KB random pre-token: " .. #ids .. " ids")
  t.eq(tok:decode(ids), random_long, "200 KB random pre-token round trips")
  local prefix = random_long:sub(1, 3000)
  t.ok(same(tok:encode(prefix), reference_encode(prefix)), "3 KB random pre-token: the same ids as GPT-2's merge loop")
end

t.done()
