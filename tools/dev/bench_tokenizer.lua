-- bench_tokenizer.lua: GPT-2 encoding and decoding speed of fsdp.tokenizer.
--
--   fsdp-lua tools/dev/bench_tokenizer.lua [FILE ...]     (default data/corpus.txt)
--   fsdp-lua tools/dev/bench_tokenizer.lua --pretoken=20,200,400,4096
--
-- --pretoken=KB,...: seconds to encode one pre-token of that many KiB of
-- seeded random lowercase letters (no spaces), once each.
--
-- Per file: a fresh tokenizer (empty piece cache) encodes the whole file
-- once; then decode. MB/s of input bytes, CPU time (os.clock), median of 3.

local tokenizer = require "fsdp.tokenizer"
local files, pretoken = {}, nil
for _, a in ipairs(arg or {}) do
  local sizes = a:match("^%-%-pretoken=(.*)$")
  if sizes then pretoken = sizes else files[#files + 1] = a end
end
if pretoken then
  local tok = tokenizer.gpt2()
  for kb in pretoken:gmatch("[^,]+") do
    local n = assert(tonumber(kb), "--pretoken: sizes in KiB, comma separated") * 1024
    local seed, letters = 1, {}
    for i = 1, n do seed = (seed * 1103515245 + 12345) % 2147483648; letters[i] = string.char(97 + seed % 26) end
    local text = table.concat(letters)
    local t0 = os.clock()
    local ids = tok:encode(text)
    print(string.format("%6d KiB of letters, one pre-token: %.2f s, %d tokens", n / 1024, os.clock() - t0, #ids))
  end
  os.exit(0)
end
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
