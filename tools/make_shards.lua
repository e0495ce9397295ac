-- make_shards.lua: a text file -> token shards in llm.c's format.
--
--   fsdp-lua tools/make_shards.lua --input=data/corpus.txt --out=shards \
--            [--tokenizer=bytes|gpt2] [--tokenizer-dir=DIR] \
--            [--val-fraction=0.1] [--shard-tokens=100000000]
--   fsdp-lua tools/make_shards.lua --help      # the options
--
-- --tokenizer=bytes (the default): tokens are the file's bytes, 0..255
-- (vocabulary 256: any text or binary file works; UTF-8 characters become
-- several tokens). --tokenizer=gpt2: GPT-2's BPE (vocabulary 50257, from
-- data/gpt2 or --tokenizer-dir), with <|endoftext|> first, as llm.c's
-- preparation scripts start each document. Each shard is a 1024-byte
-- header of 256 little-endian int32 — magic 20240520, version 1, token
-- count — then the tokens as little-endian uint16.
--
-- The last val-fraction of the tokens goes to val_000000.bin, ...; the rest
-- to train_000000.bin, ...; at most shard-tokens tokens a shard. For bytes
-- this is the same cut data.ByteLoader makes with split = "train" / "val",
-- so training on the shards and on the text file directly see the same tokens.

local data = require "fsdp.data"
local options = require "fsdp.options"

-- the same option handling as a recipe's: --help lists these, a mistake is one line
local o = options.parse(..., {
  { "input", "file", nil, "the text file to cut into token shards (required)" },
  { "out", "string", nil, "the folder the shards go to, made when missing (required)" },
  { "tokenizer", { "bytes", "gpt2" }, "bytes", "bytes: the file's bytes (vocabulary 256); gpt2: GPT-2's BPE "
    .. "(vocabulary 50257, for --preset=small)" },
  { "tokenizer_dir", "string", nil, "--tokenizer=gpt2: the folder of encoder.json and vocab.bpe (default data/gpt2)" },
  { "val_fraction", "number", 0.1, "the last fraction of the tokens that goes to the val_* shards", min = 0 },
  { "shard_tokens", "int", 100000000, "tokens per shard at most", min = 1, max = 2147483647 },
}, "make_shards.lua")
options.check("make_shards.lua", {
  { o.input ~= nil, "--input=FILE is required (the text to cut into shards; --help lists the options)" },
  { o.out ~= nil, "--out=DIR is required (the folder for the shards; --help lists the options)" },
  { o.val_fraction < 1, "--val-fraction must be below 1, got %s", o.val_fraction },
  { not o.tokenizer_dir or o.tokenizer == "gpt2", "--tokenizer-dir needs --tokenizer=gpt2" },
})
local function usage(msg) options.fail("make_shards.lua: %s", msg) end
local opts = { input = o.input, out = o.out, tokenizer = o.tokenizer, ["tokenizer-dir"] = o.tokenizer_dir }
local frac, per = o.val_fraction, o.shard_tokens

local why = require("fsdp.io").file_problem(opts.input)   -- a FIFO would hang io.open
if why then usage("cannot open input: " .. why) end
local f, err = io.open(opts.input, "rb")
if not f then usage("cannot open input: " .. tostring(err)) end
local text = f:read("*a")
f:close()
if #text == 0 then usage("input '" .. opts.input .. "' is empty") end

local out = opts.out:gsub("/+$", "")
if out == "" then out = "/" end
if not data.is_dir(out) then
  local ok = os.execute("mkdir -p '" .. out:gsub("'", "'\\''") .. "'")
  if (ok ~= 0 and ok ~= true) or not data.is_dir(out) then usage("cannot create directory '" .. out .. "'") end
end

local ffi = require "ffi"

-- The tokens, 0-based uint16 cdata, and their count.
local tokens, ntok, vocab
if opts.tokenizer == "gpt2" then
  local tokenizer = require "fsdp.tokenizer"
  local ok, tok = pcall(tokenizer.gpt2, opts["tokenizer-dir"])
  if not ok then usage(tostring(tok)) end
  local buf, n = tok:encode_buffer(text, require("fsdp.progress").bar("tokenize"))
  tokens = ffi.new("uint16_t[?]", n + 1)
  tokens[0] = tok.eot
  ffi.copy(tokens + 1, buf, 2 * n)
  ntok, vocab = n + 1, "gpt2, vocab " .. tok.vocab_size
else
  tokens, ntok, vocab = ffi.cast("const uint8_t *", text), #text, "byte-level, vocab 256"
end

-- Writes tokens[a..b] (1-based, inclusive) as split_000000.bin, ...
local function write_split(split, a, b)
  local n, idx, written = b - a + 1, 0, 0
  while written < n do
    local k = math.min(per, n - written)
    local toks = ffi.new("uint16_t[?]", k)
    local base = a - 1 + written
    for i = 0, k - 1 do toks[i] = tokens[base + i] end
    local path = string.format("%s/%s_%06d.bin", out, split, idx)
    data.write_shard(path, toks, k)
    print(string.format("wrote %s: %d tokens", path, k))
    written, idx = written + k, idx + 1
  end
  return idx
end

local ta, tb = data.split_range(ntok, frac, "train")
local va, vb = data.split_range(ntok, frac, "val")
local nt = write_split("train", ta, tb)
local nv = write_split("val", va, vb)
print(string.format("%s: %d bytes -> %d train tokens in %d shard(s), %d val tokens in %d shard(s) (%s)",
                    opts.input, #text, tb - ta + 1, nt, vb - va + 1, nv, vocab))
