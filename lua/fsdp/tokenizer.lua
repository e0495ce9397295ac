-- fsdp.tokenizer: GPT-2's byte-level BPE tokenizer, from its two standard
-- files, encoder.json (symbol -> id) and vocab.bpe (the merges, best first).
--
--   local tokenizer = require "fsdp.tokenizer"
--   local tok = tokenizer.gpt2()                   -- the copy shipped in data/gpt2
--   local tok = tokenizer.gpt2("path/to/dir")      -- a folder holding both files
--   local tok = tokenizer.gpt2{ encoder = "encoder.json", vocab = "vocab.bpe" }
--   local ids = tok:encode("Hello world")          -- { 15496, 995 }
--   local s   = tok:decode(ids)                    -- "Hello world"
--   local buf, n = tok:encode_buffer(text)         -- uint16_t[n] cdata, for shards
--   print(tokenizer.printable(ids, 50257))          -- a sample on one line (bytes for vocab 256)
--
-- Encoding is GPT-2's: the text is cut into pieces by the rule
--   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
-- (first alternative that matches, each greedy), each piece's UTF-8 bytes
-- become byte symbols, and the lowest-ranked adjacent pair is merged until no
-- pair has a rank. The rule is applied here by a hand-written scanner (no
-- regex engine), over the classes in fsdp.unicode_classes, generated from
-- the same Unicode data GPT-2's encoder uses. Bytes that are not valid UTF-8
-- count as "other" characters, so any byte string encodes, and decode gives
-- back exactly the bytes that were encoded.
--
-- "<|endoftext|>" (tok.eot, 50256) is never produced by encode: text that
-- spells it is encoded as ordinary characters, as GPT-2's encoder does.

local ffi = require "ffi"
local json = require "fsdp.json"
local classes = require "fsdp.unicode_classes"

local byte, sub, char, concat = string.byte, string.sub, string.char, table.concat
local floor = math.floor

local M = {}

-- ---- code point classes ----

local OTHER, LETTER, NUMBER, SPACE = 0, 1, 2, 3
M.OTHER, M.LETTER, M.NUMBER, M.SPACE = OTHER, LETTER, NUMBER, SPACE

-- One byte per code point (1.1 MB), filled once from the ranges: a lookup
-- in the scanner's inner loop is then one load.
local class_of = ffi.new("uint8_t[?]", 0x110000)
for cls, list in pairs({ [LETTER] = classes.letter, [NUMBER] = classes.number, [SPACE] = classes.space }) do
  for i = 1, #list, 2 do
    ffi.fill(class_of + list[i], list[i + 1] - list[i] + 1, cls)
  end
end

-- Class and byte length of the character at p[i] (i < n). A byte that does
-- not start a valid UTF-8 sequence (overlong, surrogate, beyond U+10FFFF,
-- cut short) is one OTHER character of length 1.
local function char_at(p, i, n)
  local b = p[i]
  if b < 0x80 then return class_of[b], 1 end
  local cp, len, min
  if b >= 0xF0 then
    if b > 0xF4 then return OTHER, 1 end
    cp, len, min = b - 0xF0, 4, 0x10000
  elseif b >= 0xE0 then
    cp, len, min = b - 0xE0, 3, 0x800
  elseif b >= 0xC2 then
    cp, len, min = b - 0xC0, 2, 0x80
  else
    return OTHER, 1
  end
  if i + len > n then return OTHER, 1 end
  for k = 1, len - 1 do
    local c = p[i + k]
    if c < 0x80 or c >= 0xC0 then return OTHER, 1 end
    cp = cp * 64 + (c - 0x80)
  end
  if cp < min or cp > 0x10FFFF or (cp >= 0xD800 and cp <= 0xDFFF) then return OTHER, 1 end
  return class_of[cp], len
end

-- End (exclusive) of the piece that starts at p[i], i < n: the rule above,
-- alternative by alternative.
local function piece_end(p, i, n)
  local b = p[i]
  if b == 39 and i + 1 < n then                         -- 's 't 're 've 'm 'll 'd
    local c = p[i + 1]
    if c == 115 or c == 116 or c == 109 or c == 100 then return i + 2 end
    if i + 2 < n then
      local d = p[i + 2]
      if (c == 114 and d == 101) or (c == 118 and d == 101) or (c == 108 and d == 108) then return i + 3 end
    end
  end
  local cls, len = char_at(p, i, n)
  local j = i
  if b == 32 and i + 1 < n then                         -- " ?" before letters, numbers, other
    local c2, l2 = char_at(p, i + 1, n)
    if c2 ~= SPACE then cls, len, j = c2, l2, i + 1 end
  end
  if cls ~= SPACE then                                  -- a run of one class
    j = j + len
    while j < n do
      local c, l = char_at(p, j, n)
      if c ~= cls then break end
      j = j + l
    end
    return j
  end
  -- White space: \s+(?!\S) takes the run, less its last character when
  -- something other than space follows; a lone one falls to \s+.
  local last = i
  j = i + len
  while j < n do
    local c, l = char_at(p, j, n)
    if c ~= SPACE then break end
    last, j = j, j + l
  end
  if j == n or last == i then return j end
  return last
end

--- tokenizer.pretokenize(text) -> list of pieces (strings), GPT-2's rule.
function M.pretokenize(text)
  assert(type(text) == "string", "tokenizer.pretokenize: text must be a string")
  local p, n, out, i = ffi.cast("const uint8_t *", text), #text, {}, 0
  while i < n do
    local j = piece_end(p, i, n)
    out[#out + 1] = sub(text, i + 1, j)
    i = j
  end
  return out
end

-- ---- GPT-2's byte <-> symbol map ----

-- Byte b's symbol: the printable bytes stand for themselves, the other 68
-- are moved to U+0100 and up, in byte order (GPT-2's bytes_to_unicode).
local function utf8_of(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + floor(cp / 64), 0x80 + cp % 64) end
  return char(0xE0 + floor(cp / 4096), 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
end

local byte_symbol, symbol_byte = {}, {}
do
  local shifted = 0
  for b = 0, 255 do
    local printable = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174 and b <= 255)
    local cp = b
    if not printable then cp, shifted = 256 + shifted, shifted + 1 end
    byte_symbol[b] = utf8_of(cp)
    symbol_byte[utf8_of(cp)] = char(b)
  end
end

-- The bytes a symbol string stands for (its UTF-8 characters mapped back),
-- or nil when one of them is not a byte symbol.
local function symbol_bytes(sym)
  local out, i = {}, 1
  while i <= #sym do
    local b = byte(sym, i)
    local len = b < 0x80 and 1 or b < 0xE0 and 2 or 3
    local raw = symbol_byte[sub(sym, i, i + len - 1)]
    if not raw then return nil end
    out[#out + 1] = raw
    i = i + len
  end
  return concat(out)
end

-- ---- the tokenizer ----

local Tokenizer = {}
Tokenizer.__index = Tokenizer

local function read_file(path, what)
  local why = require("fsdp.io").file_problem(path)   -- a FIFO would hang io.open
  if why then error(string.format("tokenizer: cannot open %s '%s': %s", what, path, why), 3) end
  local f, err = io.open(path, "rb")
  if not f then error(string.format("tokenizer: cannot open %s '%s': %s", what, path, tostring(err)), 3) end
  local s = f:read("*a")
  f:close()
  if not s then error(string.format("tokenizer: cannot read %s '%s' (a directory?)", what, path), 3) end
  return s
end

-- The folder of the copy shipped with fsdp-lua: data/gpt2 beside lua/, in
-- the source tree and in an installed tree alike.
local function default_dir()
  local env = os.getenv("FSDP_GPT2_TOKENIZER")
  if env and env ~= "" then return env end
  return require("fsdp.shipped").path("data/gpt2")
end
M.default_dir = default_dir

local SHORT_PIECE = 48  -- bytes; longer pieces take the heap merge loop
local PAIR = 65536     -- pair key: left id * PAIR + right id (ids < 65536)

--- tokenizer.gpt2([dir | { encoder = PATH, vocab = PATH }]) -> tokenizer.
-- Without an argument: $FSDP_GPT2_TOKENIZER, else the shipped data/gpt2.
-- Errors name the file and the line or key at fault.
function M.gpt2(where)
  local enc_path, bpe_path
  if type(where) == "table" then
    enc_path, bpe_path = where.encoder, where.vocab
    if type(enc_path) ~= "string" or type(bpe_path) ~= "string" then
      error("tokenizer.gpt2: give { encoder = 'encoder.json', vocab = 'vocab.bpe' }", 2)
    end
  else
    if where ~= nil and type(where) ~= "string" then
      error("tokenizer.gpt2: the argument is a folder (string) or { encoder =, vocab = }", 2)
    end
    local dir = (where or default_dir()):gsub("/+$", "")
    enc_path, bpe_path = dir .. "/encoder.json", dir .. "/vocab.bpe"
  end

  local ok, encoder = pcall(json.decode, read_file(enc_path, "encoder"))
  if not ok or not json.is_object(encoder) then
    error(string.format("tokenizer: '%s' is not a JSON object of symbol -> id: %s", enc_path,
                        ok and "wrong shape" or tostring(encoder)), 2)
  end
  local self = setmetatable({ encoder_path = enc_path, vocab_path = bpe_path }, Tokenizer)
  local decoder, n = {}, 0                 -- id -> bytes
  for sym, id in pairs(encoder) do
    if type(id) ~= "number" or id < 0 or id >= PAIR or id ~= floor(id) then
      error(string.format("tokenizer: '%s': id of '%s' is not an integer in [0, 65535]", enc_path, sym), 2)
    end
    if decoder[id] then error(string.format("tokenizer: '%s': id %d appears twice", enc_path, id), 2) end
    local raw = symbol_bytes(sym)
    if not raw then
      -- only special tokens ("<|endoftext|>") are outside the byte alphabet,
      -- and those spell themselves
      raw = sym
    end
    decoder[id], n = raw, math.max(n, id + 1)
  end
  self.decoder, self.vocab_size = decoder, n
  self.eot = encoder["<|endoftext|>"]

  local byte_id = ffi.new("int32_t[256]")
  for b = 0, 255 do
    local id = encoder[byte_symbol[b]]
    if not id then error(string.format("tokenizer: '%s' has no symbol for byte %d", enc_path, b), 2) end
    byte_id[b] = id
  end

  -- merges: pair key -> rank (1 = merged first) and pair key -> merged id
  local text = read_file(bpe_path, "vocab")
  local rank, merged, line_no, r = {}, {}, 0, 0
  for line in text:gmatch("([^\n]*)\n?") do
    line_no = line_no + 1
    line = line:gsub("\r$", "")
    if line_no == 1 and line:match("^#version") then
      -- the format's first line
    elseif line ~= "" then
      local a, b = line:match("^(%S+) (%S+)$")
      local ia, ib = a and encoder[a], b and encoder[b]
      local im = a and encoder[a .. b]
      if not (ia and ib and im) then
        error(string.format("tokenizer: '%s' line %d: '%s' is not a merge of two symbols of '%s' into a third",
                            bpe_path, line_no, line, enc_path), 2)
      end
      local key = ia * PAIR + ib
      if not rank[key] then
        r = r + 1
        rank[key], merged[key] = r, im
      end
    end
  end
  if r == 0 then error(string.format("tokenizer: '%s' holds no merges", bpe_path), 2) end
  self.num_merges = r
  self._rank, self._merged, self._byte_id = rank, merged, byte_id
  self._cache, self._cached = {}, 0
  self._short_piece = SHORT_PIECE   -- tests set 1 to put every piece through the heap
  return self
end

-- GPT-2's loop as written, for short pieces (most words): each pass rescans
-- the pairs, O(n^2) in all, cheaper than a heap below a few dozen bytes.
local function bpe_rescan(self, p, s, e)
  local byte_id, rank, merged = self._byte_id, self._rank, self._merged
  local word, n = {}, e - s
  for k = 1, n do word[k] = byte_id[p[s + k - 1]] end
  while n > 1 do
    local best, at = math.huge, 0
    for k = 1, n - 1 do
      local rk = rank[word[k] * PAIR + word[k + 1]]
      if rk and rk < best then best, at = rk, k end
    end
    if at == 0 then break end
    local a, b = word[at], word[at + 1]
    local m = merged[a * PAIR + b]
    -- every occurrence of the pair, left to right, as GPT-2 does
    local out, o, k = {}, 0, 1
    while k <= n do
      if k < n and word[k] == a and word[k + 1] == b then
        o = o + 1; out[o] = m; k = k + 2
      else
        o = o + 1; out[o] = word[k]; k = k + 1
      end
    end
    word, n = out, o
  end
  return word
end

-- BPE of the bytes p[s..e-1]: a list of ids. GPT-2's rule: merge every
-- occurrence, left to right, of the lowest-ranked adjacent pair, until no
-- pair has a rank. Done in O(n log n) rather than GPT-2's O(n^2) rescans:
-- the symbols are a linked list and the candidate pairs a min-heap keyed by
-- (rank, position), checked when popped (a pair whose symbols have since
-- merged is stale). One round takes every pair of the round's rank that was
-- present when the round began, in position order; pairs a merge creates
-- join the heap when the round ends, as GPT-2 would see them next pass.
local function bpe(self, p, s, e)
  local byte_id, rank, merged = self._byte_id, self._rank, self._merged
  local n = e - s
  if n <= self._short_piece then return bpe_rescan(self, p, s, e) end
  local sym = ffi.new("int32_t[?]", n + 2)     -- 1-based; sym = -1: merged away
  local nxt = ffi.new("int32_t[?]", n + 2)     -- 0: end of the list
  local prv = ffi.new("int32_t[?]", n + 2)
  for k = 1, n do sym[k], nxt[k], prv[k] = byte_id[p[s + k - 1]], k + 1, k - 1 end
  nxt[n] = 0
  local W = n + 1                              -- key = rank * W + position
  -- at most n - 1 pairs at the start and two more per merge
  local heap, hn = ffi.new("double[?]", 3 * n + 1), 0
  local function push(key)
    hn = hn + 1
    local c = hn
    while c > 1 do
      local up = floor(c / 2)
      if heap[up] <= key then break end
      heap[c] = heap[up]; c = up
    end
    heap[c] = key
  end
  local function pop()
    local top, last = heap[1], heap[hn]
    hn = hn - 1
    if hn > 0 then
      local c = 1
      while true do
        local l = c * 2
        if l > hn then break end
        if l < hn and heap[l + 1] < heap[l] then l = l + 1 end
        if heap[l] >= last then break end
        heap[c] = heap[l]; c = l
      end
      heap[c] = last
    end
    return top
  end
  local pending, pn = ffi.new("double[?]", 2 * n + 1), 0   -- keys made in this round
  local function candidate(k, now)
    local j = nxt[k]
    if j == 0 then return end
    local rk = rank[sym[k] * PAIR + sym[j]]
    if rk then
      if now then push(rk * W + k) else pn = pn + 1; pending[pn] = rk * W + k end
    end
  end
  for k = 1, n - 1 do candidate(k, true) end
  local round = -1
  while hn > 0 do
    local key = heap[1]
    local rk = floor(key / W)
    if rk ~= round and pn > 0 then
      -- the round ended: its pairs now compete
      for q = 1, pn do push(pending[q]) end
      pn = 0
    else
      pop()
      local k = key - rk * W
      local j = sym[k] >= 0 and nxt[k] or 0
      if j ~= 0 and rank[sym[k] * PAIR + sym[j]] == rk then
        round = rk
        sym[k] = merged[sym[k] * PAIR + sym[j]]
        sym[j] = -1
        local after = nxt[j]
        nxt[k] = after
        if after ~= 0 then prv[after] = k end
        if prv[k] ~= 0 then candidate(prv[k], false) end
        candidate(k, false)
      end
    end
    if hn == 0 and pn > 0 then
      for q = 1, pn do push(pending[q]) end
      pn = 0
    end
  end
  local word, o, k = {}, 0, 1
  while k ~= 0 do o = o + 1; word[o] = sym[k]; k = nxt[k] end
  return word
end

local CACHE_MAX = 1000000   -- pieces remembered; forgotten all at once past it

-- Calls emit(id) for each token of text, in order; report(done, total)
-- (optional) every MiB of text and at the end.
local function encode_with(self, text, emit, report)
  if type(text) ~= "string" then error("tokenizer:encode: text must be a string, got " .. type(text), 3) end
  local p, n, i = ffi.cast("const uint8_t *", text), #text, 0
  local cache = self._cache
  local next_report = report and 1048576 or math.huge
  while i < n do
    if i >= next_report then
      report(i, n)
      next_report = i + 1048576
    end
    local j = piece_end(p, i, n)
    local piece = sub(text, i + 1, j)
    local ids = cache[piece]
    if not ids then
      ids = bpe(self, p, i, j)
      if self._cached >= CACHE_MAX then cache = {}; self._cache = cache; self._cached = 0 end
      cache[piece] = ids
      self._cached = self._cached + 1
    end
    for k = 1, #ids do emit(ids[k]) end
    i = j
  end
  if report then report(n, n) end
end

--- tok:encode(text) -> list of token ids (1-based Lua list).
function Tokenizer:encode(text)
  local out, n = {}, 0
  encode_with(self, text, function(id) n = n + 1; out[n] = id end)
  return out
end

--- tok:encode_buffer(text[, progress]) -> uint16_t[n] cdata (0-based), n.
-- For large texts: no Lua list of every id is built. progress(done, total),
-- optional, hears how many bytes are done (fsdp.progress.bar fits).
function Tokenizer:encode_buffer(text, progress)
  if type(text) ~= "string" then error("tokenizer:encode_buffer: text must be a string, got " .. type(text), 2) end
  local cap = math.max(16, floor(#text / 3))
  local buf, n = ffi.new("uint16_t[?]", cap), 0
  encode_with(self, text, function(id)
    if n == cap then
      local bigger = ffi.new("uint16_t[?]", cap * 2)
      ffi.copy(bigger, buf, cap * 2)
      buf, cap = bigger, cap * 2
    end
    buf[n] = id
    n = n + 1
  end, progress)
  return buf, n
end

--- tok:decode(ids) -> string. ids: a Lua list, or cdata with n given. An id
-- outside the vocabulary (a padded model vocabulary) is an error naming it.
function Tokenizer:decode(ids, n)
  local decoder, parts = self.decoder, {}
  local count = n or #ids
  local base = n and 0 or 1
  for k = 0, count - 1 do
    local id = tonumber(ids[base + k])
    local raw = id and decoder[id]
    if not raw then
      error(string.format("tokenizer:decode: token %d (position %d) is not in the vocabulary of %d",
                          id or -1, k + 1, self.vocab_size), 2)
    end
    parts[k + 1] = raw
  end
  return concat(parts)
end

--- tok:token_bytes(id) -> the bytes of one token (nil when unknown).
function Tokenizer:token_bytes(id) return self.decoder[id] end

--- tokenizer.encode_for(vocab_size, text) -> ids (a Lua list): text as a
-- model of that vocabulary reads it: bytes for 256, GPT-2's BPE (from
-- tokenizer.gpt2()) for 50257; any other vocabulary has no tokenizer here
-- and is an error saying so.
function M.encode_for(vocab_size, text)
  if type(text) ~= "string" then error("tokenizer.encode_for: text must be a string, got " .. type(text), 2) end
  if vocab_size == 256 then return require("fsdp.data").encode_bytes(text) end
  if vocab_size == 50257 then return M.gpt2():encode(text) end
  error(string.format("tokenizer.encode_for: no tokenizer for a vocabulary of %s (256: bytes, 50257: GPT-2)",
    tostring(vocab_size)), 2)
end

--- tokenizer.printable(ids, vocab_size) -> text, decoded: a model's tokens
-- (a Lua list) for a log line. A vocabulary of 256 is bytes; GPT-2's
-- (50257) is decoded with tokenizer.gpt2() when its files are there and
-- every id is in it; control characters (newlines too) show as spaces, so
-- the text stays on one line. decoded is false when no decoder fits: text
-- is then the ids, separated by spaces.
function M.printable(ids, vocab_size)
  if type(ids) ~= "table" then error("tokenizer.printable: ids must be a Lua list, got " .. type(ids), 2) end
  local ok, text
  if vocab_size == 256 then
    ok, text = true, require("fsdp.data").decode_bytes(ids)
  elseif vocab_size == 50257 then
    ok, text = pcall(function() return M.gpt2():decode(ids) end)
  end
  if not ok then return concat(ids, " "), false end
  return M.valid_utf8((text:gsub("%c", " "))), true
end

-- The length of the well-formed UTF-8 sequence at s[i] (0: none there).
local function utf8_len(s, i)
  local b = byte(s, i)
  local n = b < 0x80 and 1 or (b >= 0xC2 and b <= 0xDF) and 2 or (b >= 0xE0 and b <= 0xEF) and 3
    or (b >= 0xF0 and b <= 0xF4) and 4 or 0
  if n <= 1 then return n end
  for k = 1, n - 1 do
    local c = byte(s, i + k)
    if not c or c < 0x80 or c > 0xBF then return 0 end
  end
  local b2 = byte(s, i + 1)
  if (b == 0xE0 and b2 < 0xA0) or (b == 0xED and b2 > 0x9F) or (b == 0xF0 and b2 < 0x90) or (b == 0xF4 and b2 > 0x8F)
  then
    return 0   -- overlong, a surrogate, or past U+10FFFF
  end
  return n
end

--- tokenizer.valid_utf8(s) -> s with each byte that is not part of a
-- well-formed UTF-8 character replaced by '?' (a sample cut mid-character,
-- a byte model's stray high bytes), so a terminal or a log shows text.
function M.valid_utf8(s)
  local out, i, n = {}, 1, #s
  while i <= n do
    local len = utf8_len(s, i)
    if len == 0 then
      out[#out + 1] = "?"
      i = i + 1
    else
      out[#out + 1] = sub(s, i, i + len - 1)
      i = i + len
    end
  end
  return concat(out)
end

return M
