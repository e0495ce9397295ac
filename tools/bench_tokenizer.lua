-- bench_tokenizer.lua: GPT-2 encoding and decoding speed of fsdp.tokenizer.
--
--   fsdp-lua tools/bench_tokenizer.lua [FILE ...]     (default data/corpus.txt)
--
-- Per file: a fresh tokenizer (empty piece cache) encodes the whole file
-- once; then decode. MB/s of input bytes, CPU time (os.clock), median of 3.

local tokenizer = require "fsdp.tokenizer"
local files = {}
for _, a in ipairs(arg or {}) do files[#files + 1] = a end
if #files == 0 then files[1] = "data/corpus.txt" end

local function median(xs) table.sort(xs); return xs[math.floor((#xs + 1) / 2)] end

for _, path in ipairs(files) do
  local f = assert(io.open(path, "rb"))
  local text = f:read("*a")
  f:close()
  local enc, dec, ntok = {}, {}, 0
  for r = 1, 3 do
    local tok = tokenizer.gpt2()
    local t0 = os.clock()
    local buf, n = tok:encode_buffer(text)
    local t1 = os.clock()
    local back = tok:decode(buf, n)
    local t2 = os.clock()
    assert(back == text, "round trip failed")
    enc[r], dec[r], ntok = #text / 1e6 / (t1 - t0), #text / 1e6 / (t2 - t1), n
  end
  print(string.format("%s: %.2f MB, %d tokens (%.2f bytes/token): encode %.1f MB/s, decode %.1f MB/s",
                      path, #text / 1e6, ntok, #text / ntok, median(enc), median(dec)))
end
