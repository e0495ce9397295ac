-- fsdp.data: token data for language-model training.
--
-- (a) llm.c token shards: a header of 256 little-endian int32 —
--     [0] magic 20240520, [1] version 1, [2] token count — then the tokens
--     as little-endian uint16.
-- (b) TokenLoader: batches from a set of shards. A batch is a window of
--     B*T+1 consecutive tokens: x its first B*T, y the same shifted by one
--     (the next-token targets), both (B, T). Windows never cross shards.
--     With shuffle the window order is a permutation drawn from (seed,
--     epoch); every rank walks the same order and takes its own rows of the
--     global batch, so W ranks together see exactly what one rank would.
-- (c) ByteLoader: the same over a plain file's bytes (vocabulary 256), so
--     any text file trains without a tokenizer.
--
--   local data = require "fsdp.data"
--   local L = data.TokenLoader{ pattern = "shards/train_*.bin", batch = 8, ctx = 256,
--                               seed = 1, shuffle = true, rank = r, world = w }
--   local x, y = L:next()
--   local st = L:state()   ... L:set_state(st)   -- resume exactly
--   local train, val = data.splits{ data = "shards", batch = 8, ctx = 256, seed = 1 }   -- a recipe's two loaders

local ffi = require "ffi"
local bit = require "bit"
local core = require "fsdp.core"
local fio = require "fsdp.io"
require "fsdp.tensor"          -- the metatype: tensors we make get their methods

local C = core.C
local raise = core.raise
local out, wrap = core.out, core.wrap
local fmt, concat, sort = string.format, table.concat, table.sort
local floor, min, tonumber, type = math.floor, math.min, tonumber, type

local M = {}

M.MAGIC = 20240520
M.VERSION = 1
M.HEADER_INTS = 256
M.HEADER_BYTES = 1024

local LE = ffi.abi("le")
local u16p = ffi.typeof("const uint16_t *")
local u8p = ffi.typeof("const uint8_t *")
local i32p = ffi.typeof("const int32_t *")

-- ---- shards ----

local function open_or_fail(path, mode, what)
  if type(path) ~= "string" then raise(fmt("data: %s path must be a string, got %s", what, type(path))) end
  local f, err
  if mode == "rb" then
    local why = fio.file_problem(path)   -- a FIFO or device would hang io.open
    if why then raise(fmt("data: cannot open %s '%s': %s", what, path, why)) end
    f, err = io.open(path, mode)
  else
    local ok, w = pcall(fio.replace, path)
    if ok then f = w else err = w end
  end
  if not f then
    err = tostring(err)
    if err:sub(1, #path + 2) == path .. ": " then err = err:sub(#path + 3) end
    raise(fmt("data: cannot open %s '%s': %s", what, path, err))
  end
  return f
end

-- Reads and checks a shard header from an open file.
local function check_header(f, path)
  if not LE then raise("data: token shards are little-endian; this host is not") end
  local size = f:seek("end")
  f:seek("set", 0)
  if size < M.HEADER_BYTES then
    raise(fmt("data: shard '%s' is %d bytes, shorter than its %d-byte header", path, size, M.HEADER_BYTES))
  end
  local s = f:read(M.HEADER_BYTES)
  local h = ffi.cast(i32p, s)
  local magic, version, ntok = h[0], h[1], h[2]
  if magic ~= M.MAGIC then
    raise(fmt("data: shard '%s' has bad magic %d (expected %d, an llm.c token shard)", path, magic, M.MAGIC))
  end
  if version ~= M.VERSION then
    raise(fmt("data: shard '%s' has unsupported version %d (expected %d: uint16 tokens)", path, version, M.VERSION))
  end
  local held = floor((size - M.HEADER_BYTES) / 2)
  if ntok < 0 or ntok > held then
    raise(fmt("data: shard '%s' header says %d tokens but the file holds only %d", path, ntok, held))
  end
  if size ~= M.HEADER_BYTES + 2 * ntok then
    raise(fmt("data: shard '%s' is %d bytes, but its header says %d tokens (%d bytes with the header): %d bytes "
      .. "too many (a damaged shard, or not uint16 tokens?)", path, size, ntok, M.HEADER_BYTES + 2 * ntok,
      size - M.HEADER_BYTES - 2 * ntok))
  end
  return { path = path, magic = magic, version = version, ntok = ntok, bytes = size }
end

--- data.read_shard_header(path) -> { path, magic, version, ntok, bytes }.
-- Checks magic, version and that the file holds exactly the tokens it
-- claims (no fewer, no trailing bytes).
function M.read_shard_header(path)
  local f = open_or_fail(path, "rb", "shard")
  local ok, res = pcall(check_header, f, path)
  f:close()
  if not ok then error(res, 0) end
  return res
end

--- data.read_shard(path) -> uint16_t[n] cdata (0-based), n: all its tokens.
function M.read_shard(path)
  local f = open_or_fail(path, "rb", "shard")
  local ok, hdr = pcall(check_header, f, path)
  if not ok then f:close(); error(hdr, 0) end
  local n = hdr.ntok
  local s = n > 0 and f:read(2 * n) or ""
  f:close()
  if #s ~= 2 * n then raise(fmt("data: shard '%s' truncated while reading", path)) end
  local toks = ffi.new("uint16_t[?]", n > 0 and n or 1)
  ffi.copy(toks, s, 2 * n)
  return toks, n
end

--- data.write_shard(path, tokens, n): tokens a Lua list (1-based) of
-- integers in [0, 65535], or uint16 cdata (0-based) with n given.
function M.write_shard(path, tokens, n)
  if not LE then raise("data: token shards are little-endian; this host is not") end
  local buf
  if type(tokens) == "table" then
    n = n or #tokens
    buf = ffi.new("uint16_t[?]", n > 0 and n or 1)
    for i = 1, n do
      local v = tokens[i]
      if type(v) ~= "number" or v < 0 or v > 65535 or v ~= floor(v) then
        raise(fmt("data.write_shard: %s: token %d is %s (tokens are integers in [0, 65535])", path, i, tostring(v)))
      end
      buf[i - 1] = v
    end
  elseif type(tokens) == "cdata" then
    if type(n) ~= "number" then raise("data.write_shard: " .. path .. ": n is required with cdata tokens") end
    buf = ffi.cast(u16p, tokens)
  else
    raise(fmt("data.write_shard: %s: tokens must be a table or uint16 cdata, got %s", path, type(tokens)))
  end
  if n > 2147483647 then raise("data.write_shard: " .. path .. ": more tokens than an int32 count holds") end
  local hdr = ffi.new("int32_t[256]")
  hdr[0], hdr[1], hdr[2] = M.MAGIC, M.VERSION, n
  local f = open_or_fail(path, "wb", "shard")
  local ok, err = pcall(function()
    assert(f:write(ffi.string(hdr, M.HEADER_BYTES)))
    local done, chunk = 0, 1048576
    while done < n do
      local k = min(chunk, n - done)
      assert(f:write(ffi.string(buf + done, 2 * k)))
      done = done + k
    end
    f:publish()
  end)
  if not ok then
    f:abort()
    raise("data.write_shard: " .. path .. ": write failed: " .. tostring(err))
  end
  return n
end

-- ---- bytes as tokens ----

--- data.encode_bytes(str) -> { byte values } (a Lua list, vocab 256).
function M.encode_bytes(s)
  local t = {}
  for i = 1, #s do t[i] = s:byte(i) end
  return t
end

local int_box = ffi.new("int[1]")
local i64_box = ffi.new("int64_t[1]")
local int_elem = { [2] = "int32_t[?]", [3] = "int64_t[?]", [4] = "uint16_t[?]" }
local int_size = { [2] = 4, [3] = 8, [4] = 2 }

--- data.decode_bytes(tokens) -> string. tokens: a Lua list or an integer
-- tensor (any shape, read row-major). Ids outside 0..255 (a padded
-- vocabulary) come out as '?'.
function M.decode_bytes(tokens)
  local vals, n
  if type(tokens) == "table" then
    vals, n = tokens, #tokens
  elseif ffi.istype(core.tensor_ptr, tokens) then
    if C.fsdp_tensor_dtype(tokens, int_box) ~= 0 then raise() end
    local dt = int_box[0]
    if not int_elem[dt] then raise("data.decode_bytes: expected an integer tensor, got " .. core.dtype_names[dt]) end
    if C.fsdp_tensor_numel(tokens, i64_box) ~= 0 then raise() end
    n = tonumber(i64_box[0])
    local buf = ffi.new(int_elem[dt], n > 0 and n or 1)
    if C.fsdp_tensor_to_data(tokens, buf, n * int_size[dt]) ~= 0 then raise() end
    vals = {}
    for i = 1, n do vals[i] = tonumber(buf[i - 1]) end
  else
    raise("data.decode_bytes: expected a list or a tensor, got " .. type(tokens))
  end
  local parts = {}
  for i = 1, n do
    local v = vals[i]
    parts[i] = (type(v) == "number" and v >= 0 and v <= 255 and v == floor(v)) and string.char(v) or "?"
  end
  return concat(parts)
end

-- ---- globbing ----

-- A glob of the file-name part (*, ?, [abc], [!abc]) as an anchored Lua pattern.
local function glob_to_pattern(g)
  local p, i = { "^" }, 1
  while i <= #g do
    local c = g:sub(i, i)
    if c == "*" then
      p[#p + 1] = ".*"
    elseif c == "?" then
      p[#p + 1] = "."
    elseif c == "[" then
      local j = g:find("]", i + 2, true)
      if not j then
        p[#p + 1] = "%["
      else
        local set = g:sub(i + 1, j - 1)
        local neg = set:sub(1, 1) == "!" or set:sub(1, 1) == "^"
        if neg then set = set:sub(2) end
        set = set:gsub("[%%%]%^]", "%%%0")
        p[#p + 1] = "[" .. (neg and "^" or "") .. set .. "]"
        i = j
      end
    else
      p[#p + 1] = c:gsub("[%^%$%(%)%%%.%[%]%+%-]", "%%%0")
    end
    i = i + 1
  end
  p[#p + 1] = "$"
  return concat(p)
end

local is_dir = fio.is_dir
M.is_dir = is_dir

--- data.glob(pattern) -> sorted list of paths. Wildcards only in the last
-- path component; a pattern without wildcards comes back as itself.
function M.glob(pattern)
  if type(pattern) ~= "string" then raise("data.glob: pattern must be a string, got " .. type(pattern)) end
  local dir, base = pattern:match("^(.*)/([^/]*)$")
  if not dir then dir, base = ".", pattern end
  if not base:find("[%*%?%[]") then return { pattern } end
  if dir:find("[%*%?%[]") then
    raise("data.glob: '" .. pattern .. "': wildcards are only supported in the file name")
  end
  local where = dir == "" and "/" or dir
  local names = is_dir(where) and fio.list_dir(where) or {}
  local lp = glob_to_pattern(base)
  local hidden = base:sub(1, 1) == "."
  local res = {}
  for _, name in ipairs(names) do
    if name:find(lp) and (hidden or name:sub(1, 1) ~= ".") then
      res[#res + 1] = (pattern:find("/") and (dir .. "/") or "") .. name
    end
  end
  sort(res)
  return res
end

-- ---- the shuffling RNG: splitmix64 on uint64 cdata ----

local U64 = ffi.typeof("uint64_t")
local bxor, rshift = bit.bxor, bit.rshift
local GOLDEN = 0x9E3779B97F4A7C15ULL

local function mix(z)
  z = bxor(z, rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
  z = bxor(z, rshift(z, 27)) * 0x94D049BB133111EBULL
  return bxor(z, rshift(z, 31))
end

-- A permutation of 0..n-1 (int32 array) that depends only on (seed, epoch):
-- Fisher-Yates driven by splitmix64.
local function permutation(n, seed, epoch)
  local perm = ffi.new("int32_t[?]", n > 0 and n or 1)
  for i = 0, n - 1 do perm[i] = i end
  local state = bxor(mix(U64(seed) + GOLDEN), mix(U64(epoch) * GOLDEN + 0x632BE59BD9B4E019ULL))
  for i = n - 1, 1, -1 do
    state = state + GOLDEN
    local j = tonumber(mix(state) % U64(i + 1))
    perm[i], perm[j] = perm[j], perm[i]
  end
  return perm
end
M._permutation = permutation

-- ---- the loader ----

local Loader = {}
Loader.__index = Loader

local out_dtypes = { i64 = { 3, "int64_t[?]", 8 }, int64 = { 3, "int64_t[?]", 8 },
                     i32 = { 2, "int32_t[?]", 4 }, int32 = { 2, "int32_t[?]", 4 } }

local function int_opt(opts, key, default, lo, what)
  local v = opts[key]
  if v == nil then v = default end
  if type(v) ~= "number" or v ~= floor(v) or v < lo then
    raise(fmt("%s: %s must be an integer >= %d, got %s", what, key, lo, tostring(v)))
  end
  return v
end

-- Common set-up. segs: list of { name, ntok }; self.read(seg, start, count)
-- gives a pointer to count tokens and an anchor that keeps them alive.
local function new_loader(what, opts, segs, read, vocab)
  local B = int_opt(opts, "batch", nil, 1, what)
  local T = int_opt(opts, "ctx", nil, 1, what)
  local rank = int_opt(opts, "rank", 0, 0, what)
  local world = int_opt(opts, "world", 1, 1, what)
  local seed = int_opt(opts, "seed", 0, 0, what)
  if rank >= world then raise(fmt("%s: rank %d is not below world %d", what, rank, world)) end
  if B % world ~= 0 then
    raise(fmt("%s: batch %d is not divisible by world %d (each rank takes batch/world rows)", what, B, world))
  end
  local od = out_dtypes[opts.dtype or "i64"]
  if not od then raise(what .. ": dtype must be i64 or i32, got " .. tostring(opts.dtype)) end

  local win = B * T                   -- tokens a window advances by
  local nwin, total_tokens = 0, 0
  for _, s in ipairs(segs) do
    if s.ntok < win + 1 then
      raise(fmt("%s: '%s' has %d tokens, fewer than batch*ctx+1 = %d*%d+1 = %d",
                what, s.name, s.ntok, B, T, win + 1))
    end
    s.nwin = floor((s.ntok - 1) / win)
    nwin = nwin + s.nwin
    total_tokens = total_tokens + s.ntok
  end
  if nwin == 0 then raise(what .. ": no data") end

  -- Window g (0-based, in file order) -> segment and first token.
  local win_seg = ffi.new("int32_t[?]", nwin)
  local win_start = ffi.new("int64_t[?]", nwin)
  local g = 0
  for k, s in ipairs(segs) do
    for j = 0, s.nwin - 1 do
      win_seg[g] = k
      win_start[g] = j * win
      g = g + 1
    end
  end

  local rows = B / world
  local self = setmetatable({
    what = what, B = B, T = T, rank = rank, world = world, rows = rows,
    seed = seed, shuffle = opts.shuffle and true or false,
    segments = segs, read = read, vocab = vocab,
    n_windows = nwin, n_tokens = total_tokens,
    batches_per_epoch = nwin,
    win_seg = win_seg, win_start = win_start,
    out_dtype = od[1], out_size = od[3],
    xbuf = ffi.new(od[2], rows * T), ybuf = ffi.new(od[2], rows * T),
    shape = ffi.new("int64_t[2]", rows, T),
    device = core.device_id(opts.device), tag = core.tag_id(opts.tag, 5),
    epoch = 0, index = 0,
  }, Loader)
  self:_order()
  return self
end

function Loader:_order()
  self.order = self.shuffle and permutation(self.n_windows, self.seed, self.epoch) or nil
end

-- Copies m tokens from p (uint8 or uint16) into x, and p shifted by one into y.
local function fill(x, y, p, m)
  for i = 0, m - 1 do
    x[i] = p[i]
    y[i] = p[i + 1]
  end
end

local function to_tensor(self, buf)
  local m = self.rows * self.T
  if C.fsdp_tensor_from_data(out, self.out_dtype, 2, self.shape, buf, m * self.out_size,
                             self.device, self.tag) ~= 0 then
    raise()
  end
  return wrap()
end

--- loader:next() -> x, y: integer tensors (rows, T), rows = batch/world:
-- this rank's rows of the next global batch; y is x shifted by one token.
function Loader:next()
  if self.index >= self.n_windows then
    self.epoch = self.epoch + 1
    self.index = 0
    self:_order()
  end
  local g = self.order and self.order[self.index] or self.index
  self.index = self.index + 1
  local m = self.rows * self.T
  local start = self.win_start[g] + self.rank * m
  local p, anchor = self.read(self.segments[self.win_seg[g]], tonumber(start), m + 1)
  self._anchor = anchor          -- p points into it: keep it alive through fill
  fill(self.xbuf, self.ybuf, p, m)
  return to_tensor(self, self.xbuf), to_tensor(self, self.ybuf)
end

--- loader:max_token(limit) -> the largest token id among the first limit
-- (default 2^20) tokens of the data, in file order: a cheap look at which
-- vocabulary it was made for, before a model is built for it.
function Loader:max_token(limit)
  if self.synthetic then return self.vocab - 1 end   -- its ids span the vocabulary it stands for
  limit = limit or 2 ^ 20
  local top = -1
  for _, seg in ipairs(self.segments) do
    if limit <= 0 then break end
    local n = math.min(limit, seg.ntok)
    limit = limit - n
    local p, anchor = self.read(seg, 0, n)
    for i = 0, n - 1 do
      local v = p[i]
      if v > top then top = v end
    end
    self._anchor = anchor
  end
  return tonumber(top)
end

--- loader:first_beyond(vocab) -> nil, or name, position, id of the first
-- token id >= vocab in the data (position counts tokens from the start of
-- that shard or file, 0-based). Reads all of it, 4 Mi tokens at a time: a
-- scan of seconds per GB, done once when the data is opened, so that an id
-- the model has no row for is found before any step.
function Loader:first_beyond(vocab)
  if self.synthetic then return nil end
  local CHUNK = 4194304
  for _, seg in ipairs(self.segments) do
    local at = 0
    while at < seg.ntok do
      local n = math.min(CHUNK, seg.ntok - at)
      local p, anchor = self.read(seg, at, n)
      for i = 0, n - 1 do
        if p[i] >= vocab then
          local id = tonumber(p[i])
          self._anchor = anchor
          return seg.name, at + i, id
        end
      end
      self._anchor = anchor
      at = at + n
    end
  end
  return nil
end

--- loader:state() -> { epoch, index, seed, windows }: where the next batch
-- comes from; plain numbers, fit for a JSON checkpoint.
function Loader:state()
  return { epoch = self.epoch, index = self.index, seed = self.seed, windows = self.n_windows }
end

--- loader:set_state(st): continue exactly where state() was taken.
function Loader:set_state(st)
  if type(st) ~= "table" then raise(self.what .. ":set_state: expected a table, got " .. type(st)) end
  local e, i = st.epoch, st.index
  if type(e) ~= "number" or e < 0 or e ~= floor(e) or type(i) ~= "number" or i < 0 or i ~= floor(i) then
    raise(self.what .. ":set_state: epoch and index must be non-negative integers")
  end
  if st.windows ~= nil and st.windows ~= self.n_windows then
    raise(fmt("%s:set_state: the state is for %d windows per epoch, this data has %d (different data, batch or ctx?)",
              self.what, st.windows, self.n_windows))
  end
  if st.seed ~= nil and st.seed ~= self.seed then
    raise(fmt("%s:set_state: the state is for seed %d, this loader has seed %d", self.what, st.seed, self.seed))
  end
  if i > self.n_windows then
    raise(fmt("%s:set_state: index %d is beyond the %d windows of an epoch", self.what, i, self.n_windows))
  end
  self.epoch, self.index = e, i
  self:_order()
end

--- loader:reset(): back to epoch 0, first batch.
function Loader:reset()
  self.epoch, self.index = 0, 0
  self:_order()
end

function Loader:close()
  if self._close then self._close() end
end

--- data.TokenLoader{ pattern = glob | {paths} | directory, batch = B, ctx = T,
--   seed = 0, shuffle = false, rank = 0, world = 1, split = "train"|"val",
--   dtype = "i64"|"i32", device, tag }
-- With a directory and split, the files are DIR/<split>_*.bin.
function M.TokenLoader(opts)
  local what = "data.TokenLoader"
  if type(opts) ~= "table" then raise(what .. ": expected an options table") end
  local pat = opts.pattern
  local files
  if type(pat) == "table" then
    files = {}
    for i, p in ipairs(pat) do files[i] = p end
  elseif type(pat) == "string" then
    if is_dir(pat) then
      pat = pat:gsub("/+$", "") .. "/" .. (opts.split and (opts.split .. "_") or "") .. "*.bin"
    elseif opts.split then
      raise(what .. ": split = '" .. tostring(opts.split) .. "' needs pattern to be a directory")
    end
    files = M.glob(pat)
  else
    raise(what .. ": pattern must be a glob, a directory or a list of paths")
  end
  if #files == 0 then raise(fmt("%s: no files match '%s'", what, tostring(pat))) end

  local segs = {}
  for i, path in ipairs(files) do
    local h = M.read_shard_header(path)
    segs[i] = { name = path, ntok = h.ntok }
  end

  -- Open handles, a few at a time: shuffled windows hop between shards.
  local handles, nopen = {}, 0
  local function close_all()
    for k, f in pairs(handles) do f:close(); handles[k] = nil end
    nopen = 0
  end
  local function read(seg, start, count)
    local f = handles[seg]
    if not f then
      if nopen >= 16 then close_all() end
      f = open_or_fail(seg.name, "rb", "shard")
      handles[seg] = f
      nopen = nopen + 1
    end
    f:seek("set", M.HEADER_BYTES + 2 * start)
    local s = f:read(2 * count)
    if not s or #s ~= 2 * count then
      raise(fmt("%s: shard '%s' changed or was truncated while reading", what, seg.name))
    end
    return ffi.cast(u16p, s), s
  end

  local L = new_loader(what, opts, segs, read, 65536)
  L.files = files
  L._close = close_all
  return L
end

--- data.ByteLoader{ path = textfile, batch, ctx, seed, shuffle, rank, world,
--   split = nil|"train"|"val", val_fraction = 0.1, dtype, device, tag }
-- Tokens are the file's bytes (vocab 256). split takes the first
-- (1 - val_fraction) of the bytes for "train" and the rest for "val",
-- the same cut as tools/make_shards.lua.
function M.ByteLoader(opts)
  local what = "data.ByteLoader"
  if type(opts) ~= "table" then raise(what .. ": expected an options table") end
  local f = open_or_fail(opts.path, "rb", "text file")
  local text = f:read("*a")
  f:close()
  local split = opts.split
  if split ~= nil then
    local a, b = M.split_range(#text, opts.val_fraction or 0.1, split, what)
    text = text:sub(a, b)
  end
  local name = opts.path .. (split and (" (" .. split .. ")") or "")
  local segs = { { name = name, ntok = #text } }
  local base = ffi.cast(u8p, text)
  local function read(_, start, _count)
    return base + start, text
  end
  local L = new_loader(what, opts, segs, read, 256)
  L.files = { opts.path }
  L.text = text          -- keeps the bytes base points into alive
  return L
end

-- ---- synthetic tokens: what the planner feeds (fsdp.dryrun) ----

-- While on (data.synthetic(true)), data.open reads nothing: a loader of the
-- asked shape gives token ids below the vocabulary of the kind of data the
-- path names (a text file's 256 bytes, GPT-2's 50257 tokens for shards),
-- so a plan neither needs the data nor depends on how much of it there is.
local synthetic_on = false

--- data.synthetic(on) -> whether it was on before.
function M.synthetic(on)
  local was = synthetic_on
  synthetic_on = on and true or false
  return was
end

M.GPT2_VOCAB = 50257

local function synthetic_loader(path, split, opts)
  local shards = type(path) == "string" and (is_dir(path) or path:match("%.bin$") or path:match("[%*%?]"))
  local vocab = shards and M.GPT2_VOCAB or 256
  local rows = int_opt(opts, "batch", nil, 1, "data.synthetic") / int_opt(opts, "world", 1, 1, "data.synthetic")
  local m = math.max(1, math.floor(rows)) * int_opt(opts, "ctx", nil, 1, "data.synthetic") + 1
  -- one rank's window, the same for every window: ids spread over the vocabulary
  local ids = ffi.new("uint16_t[?]", m)
  for i = 0, m - 1 do ids[i] = (i * 7919) % vocab end
  local name = "synthetic tokens for " .. tostring(path) .. (split and (" (" .. split .. ")") or "")
  local windows = 1024   -- an epoch long enough for any plan
  local segs = { { name = name, ntok = windows * (m - 1) * int_opt(opts, "world", 1, 1, "data.synthetic") + m } }
  local L = new_loader("data.synthetic", opts, segs, function() return ids, ids end, vocab)
  L.files, L.synthetic = {}, true
  return L
end

-- ---- a recipe's data: training and held-out loaders from a path ----

-- Mistakes in the paths a user gave are usage errors: one line, exit 2.
local function usage_error(...) require("fsdp.options").fail(...) end

--- data.open(path, split, spec) -> a loader. path is a text file (its bytes
-- are the tokens), a folder of .bin token shards, a glob of them or one
-- shard; split nil (all of it), "train" or "val" picks the part:
-- a text file's first nine tenths or last tenth (data.split_range), a
-- folder's train_*.bin or val_*.bin, a glob's shards but the last or its
-- last (a glob of one shard gives that shard to both). spec holds the loader
-- options (batch, ctx, seed, shuffle, rank, world, dtype, device, tag) and
-- spec.what, the name that prefixes a usage error (default "data.open"):
-- a missing or unreadable file, a folder without shards, a glob that
-- matches none. Damaged shards raise the loaders' own errors.
function M.open(path, split, spec)
  local what = spec.what or "data.open"
  if type(path) ~= "string" then usage_error("%s: the data path must be a string, got %s", what, type(path)) end
  if split ~= nil and split ~= "train" and split ~= "val" then
    raise(fmt("%s: split must be nil, 'train' or 'val', got '%s'", what, tostring(split)))
  end
  local opts = {}
  for k, v in pairs(spec) do if k ~= "what" and k ~= "flag" then opts[k] = v end end
  if synthetic_on then return synthetic_loader(path, split, opts) end
  if spec.flag then   -- the option the path came from, named first: "gpt2.lua: --data=nope.txt: ..."
    what = fmt("%s: %s=%s", what, spec.flag, path)
    local why = not is_dir(path) and not path:match("[%*%?%[]") and require("fsdp.options").file_problem(path)
    if why then usage_error("%s: %s", what, why) end
  end
  if is_dir(path) then
    local want = (split and split .. "_" or "") .. "*.bin"
    opts.pattern = M.glob(path:gsub("/+$", "") .. "/" .. want)
    if #opts.pattern == 0 then usage_error("%s: no token shards (%s) in the folder %s", what, want, path) end
  elseif path:match("%.bin$") or path:match("[%*%?]") then
    local files = M.glob(path)
    if #files == 0 then usage_error("%s: no token shards match '%s'", what, path) end
    opts.pattern = files
    if split and #files > 1 then
      opts.pattern = split == "val" and { files[#files] } or { unpack(files, 1, #files - 1) }
    end
  else
    local why = require("fsdp.options").file_problem(path)
    if why then usage_error("%s: '%s': %s", what, path, why) end
    opts.path, opts.split = path, split
    return M.ByteLoader(opts)
  end
  return M.TokenLoader(opts)
end

--- data.splits{ data = PATH, val_data = PATH or nil, batch, ctx, seed = 0,
--   shuffle = true, rank, world, what, flags, ... } -> train, val: the loaders of a
-- training run. Training reads data; evaluation reads val_data when given
-- (and training then all of data), else the part of data held out from
-- training (data.open's "val" split, training its "train" split), whose
-- order is drawn from seed + 1. rank and world default
-- to this process's place in the job (fsdp.distributed). Both paths are
-- checked before the first batch is read, the training path first.
-- flags = { data = "--data", val_data = "--val-data" } names the options
-- the paths came from in the messages of a missing file or shard.
function M.splits(opts)
  if type(opts) ~= "table" then raise("data.splits: expected an options table") end
  local spec, flags = {}, opts.flags or {}
  for k, v in pairs(opts) do if k ~= "data" and k ~= "val_data" and k ~= "flags" then spec[k] = v end end
  local function open(path, split, flag)
    spec.flag = flag
    local loader = M.open(path, split, spec)
    spec.flag = nil
    return loader
  end
  local dist = require "fsdp.distributed"
  if spec.rank == nil then spec.rank = dist.rank() end
  if spec.world == nil then spec.world = dist.world() end
  if spec.shuffle == nil then spec.shuffle = true end
  spec.seed = spec.seed or 0
  spec.what = spec.what or "data.splits"
  if opts.val_data then
    return open(opts.data, nil, flags.data), open(opts.val_data, nil, flags.val_data)
  end
  local train = open(opts.data, "train", flags.data)
  spec.seed = spec.seed + 1
  return train, open(opts.data, "val", flags.data)
end

--- data.split_range(n, val_fraction, split) -> first, last (1-based, inclusive):
-- the byte range of a split. val is the last val_fraction of the bytes.
function M.split_range(n, frac, split, what)
  what = what or "data.split_range"
  if type(frac) ~= "number" or frac < 0 or frac >= 1 then
    raise(fmt("%s: val_fraction must be in [0, 1), got %s", what, tostring(frac)))
  end
  local nval = floor(n * frac + 0.5)
  if split == "train" then return 1, n - nval end
  if split == "val" then return n - nval + 1, n end
  raise(fmt("%s: split must be 'train' or 'val', got %s", what, tostring(split)))
end

return M
