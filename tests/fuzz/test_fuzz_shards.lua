-- Fuzzed llm.c token shards (bounded, seeded): a shard of an odd number of
-- tokens damaged --cases times: a bit flipped in the header's magic,
-- version or count, the count set to values near and far, reserved header
-- words changed (allowed), a token byte changed (allowed), the file
-- truncated or grown by a byte or more. Each case is read by data.read_shard
-- and by a TokenLoader over it, and by an independent reader written here
-- from the format (256 little-endian int32: magic 20240520, version 1,
-- count; then exactly count little-endian uint16). A read that succeeds
-- must give exactly the reference's tokens; one the reference refuses must
-- fail with the file's name.
--   fsdp-lua tests/fuzz/test_fuzz_shards.lua --cases=300 --seed=1
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local data = require "fsdp.data"
local fio = require "fsdp.io"

local opts = ... or {}
local ncases = tonumber(opts.cases or 300)
local seed = tonumber(opts.seed or 1)

local state = seed * 2654435761 % 4294967296
local function rand(n)   -- 1..n
  state = (state * 1103515245 + 12345) % 2147483648
  return math.floor(state / 65536) % n + 1
end

local tmp = os.tmpname()
os.remove(tmp)
fio.mkdirs(tmp)

local NTOK = 257
local toks = {}
for i = 1, NTOK do toks[i] = (i * 40503) % 65536 end
local base_path = tmp .. "/base.bin"
data.write_shard(base_path, toks)
local base = fio.read_file(base_path)

-- the reference: the format read byte by byte
local function int32_at(s, word)   -- word 0-based
  local b1, b2, b3, b4 = s:byte(4 * word + 1, 4 * word + 4)
  local v = b1 + 256 * (b2 + 256 * (b3 + 256 * b4))
  return v >= 2 ^ 31 and v - 2 ^ 32 or v
end
local function reference(s)
  if #s < 1024 then return nil end
  local magic, version, n = int32_at(s, 0), int32_at(s, 1), int32_at(s, 2)
  if magic ~= 20240520 or version ~= 1 or n < 0 or #s ~= 1024 + 2 * n then return nil end
  local out = {}
  for i = 1, n do
    local lo, hi = s:byte(1024 + 2 * i - 1, 1024 + 2 * i)
    out[i] = lo + 256 * hi
  end
  return out
end

local function le32(v)
  if v < 0 then v = v + 2 ^ 32 end
  local b = {}
  for i = 1, 4 do b[i] = string.char(v % 256); v = math.floor(v / 256) end
  return table.concat(b)
end
local function set_word(s, word, v) return s:sub(1, 4 * word) .. le32(v) .. s:sub(4 * word + 5) end
local function replace_at(s, i, c) return s:sub(1, i - 1) .. c .. s:sub(i + 1) end

local edits = {
  header_bit = function(s)
    local i = rand(12)
    return replace_at(s, i, string.char(bit.bxor(s:byte(i), bit.lshift(1, rand(8) - 1))))
  end,
  count = function(s)
    local v = ({ NTOK - 1, NTOK + 1, 0, -1, 2 ^ 31 - 1, -2 ^ 31, NTOK * 2, NTOK - 100 })[rand(8)]
    return set_word(s, 2, v)
  end,
  version = function(s) return set_word(s, 1, ({ 0, 2, 3, -1, 20240520 })[rand(5)]) end,
  magic = function(s) return set_word(s, 0, ({ 20240521, 0, 1, 20240519 })[rand(4)]) end,
  reserved = function(s) return set_word(s, 3 + rand(253) - 1, rand(1000000)) end,   -- allowed
  token = function(s) return replace_at(s, 1024 + rand(2 * NTOK), string.char(rand(256) - 1)) end,   -- allowed
  truncate = function(s) return s:sub(1, #s - rand(#s)) end,
  truncate1 = function(s) return s:sub(1, #s - 1) end,
  grow = function(s) return s .. string.rep("\7", rand(5)) end,
}
local names = {}
for k in pairs(edits) do names[#names + 1] = k end
table.sort(names)

local counts = { refused = 0, loaded = 0, silent = 0, refused_valid = 0, unnamed = 0, loader_bad = 0 }
for k = 1, ncases do
  local kind = names[rand(#names)]
  local bytes = edits[kind](base)
  local path = string.format("%s/case_%04d.bin", tmp, k)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  local ref = reference(bytes)
  local ok, got, n = pcall(data.read_shard, path)
  if ok then
    counts.loaded = counts.loaded + 1
    local same = ref ~= nil and n == #ref
    if same then for i = 1, n do if got[i - 1] ~= ref[i] then same = false end end end
    if not same then
      counts.silent = counts.silent + 1
      print(string.format("SILENT DIFFERENCE: case %d (%s)", k, kind))
    end
    -- a loader over it gives the same tokens (x is tokens 0..T-1 of window 0)
    local okl, L = pcall(data.TokenLoader, { pattern = { path }, batch = 1, ctx = 8, dtype = "i32", device = "cpu" })
    if okl and n >= 9 then
      local x, y = L:next()
      local xs, ys = x:view(-1):tolist(), y:view(-1):tolist()
      for i = 1, 8 do
        if xs[i] ~= ref[i] or ys[i] ~= ref[i + 1] then counts.loader_bad = counts.loader_bad + 1 break end
      end
      L:close()
    elseif not okl and n >= 9 then
      counts.loader_bad = counts.loader_bad + 1
    end
  else
    counts.refused = counts.refused + 1
    if ref then
      counts.refused_valid = counts.refused_valid + 1
      print(string.format("refused a valid shard: case %d (%s): %s", k, kind, tostring(got)))
    end
    if not tostring(got):find(path, 1, true) then counts.unnamed = counts.unnamed + 1 end
    local okl = pcall(data.TokenLoader, { pattern = { path }, batch = 1, ctx = 1 })
    if okl then counts.loader_bad = counts.loader_bad + 1 end
  end
end

print(string.format("fuzz.shards: %d cases (seed %d): %d refused with an error, %d read (each equal to the "
  .. "reference), %d silent differences, %d valid shards refused, %d loader disagreements, 0 crashes", ncases, seed,
  counts.refused, counts.loaded, counts.silent, counts.refused_valid, counts.loader_bad))
t.eq(counts.silent, 0, "no shard reads differently from the reference")
t.eq(counts.refused_valid, 0, "no valid shard is refused")
t.eq(counts.unnamed, 0, "every error names the file")
t.eq(counts.loader_bad, 0, "TokenLoader accepts and refuses the same shards, with the same tokens")
t.ok(counts.refused > ncases / 3 and counts.loaded > ncases / 10, "the cases include both outcomes")
fio.remove_tree(tmp)
t.done()
