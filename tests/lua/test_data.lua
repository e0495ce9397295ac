-- Tests for fsdp.data: llm.c shards, TokenLoader (determinism, targets,
-- rank/world slicing, resumable state), ByteLoader, and tools/make_shards.lua.

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local ffi = require "ffi"
local fsdp = require "fsdp"
local data = require "fsdp.data"

local tmp = os.tmpname()
os.remove(tmp)
assert(os.execute("mkdir -p '" .. tmp .. "'"))
local function P(name) return tmp .. "/" .. name end

local function write(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  return path
end

local function header(magic, version, n)
  local h = ffi.new("int32_t[256]")
  h[0], h[1], h[2] = magic, version, n
  return ffi.string(h, 1024)
end

local function same(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do
    if type(a[i]) == "table" then
      if not same(a[i], b[i]) then return false end
    elseif a[i] ~= b[i] then
      return false
    end
  end
  return true
end

-- ======================= shards =======================

do
  local toks = {}
  for i = 1, 3000 do toks[i] = (i * 7919) % 65536 end
  toks[1], toks[2] = 0, 65535
  local p = P("a.bin")
  t.eq(data.write_shard(p, toks), 3000, "write_shard returns the count")
  local h = data.read_shard_header(p)
  t.eq(h.magic, 20240520, "header magic")
  t.eq(h.version, 1, "header version")
  t.eq(h.ntok, 3000, "header token count")
  t.eq(h.bytes, 1024 + 2 * 3000, "file size")
  local back, n = data.read_shard(p)
  t.eq(n, 3000, "read_shard count")
  local okv = true
  for i = 1, n do if back[i - 1] ~= toks[i] then okv = false end end
  t.ok(okv, "shard tokens round trip (0 and 65535 included)")

  -- cdata input, and n smaller than the array
  local c = ffi.new("uint16_t[10]", 5, 6, 7, 8, 9, 10, 11, 12, 13, 14)
  data.write_shard(P("c.bin"), c, 4)
  local b2, n2 = data.read_shard(P("c.bin"))
  t.ok(n2 == 4 and b2[0] == 5 and b2[3] == 8, "write_shard from cdata with n")
  data.write_shard(P("empty.bin"), {})
  t.eq(data.read_shard_header(P("empty.bin")).ntok, 0, "empty shard")

  -- The bytes are exactly llm.c's layout.
  local f = io.open(P("c.bin"), "rb")
  local s = f:read("*a")
  f:close()
  t.ok(s == header(20240520, 1, 4) .. "\5\0\6\0\7\0\8\0", "byte layout: 256 int32 LE header then uint16 LE")

  t.raises(function() data.write_shard(P("bad.bin"), { 1, 70000 }) end, { "bad.bin", "token 2", "70000" },
           "write_shard rejects tokens above 65535")
  t.raises(function() data.write_shard(P("bad.bin"), { 1, -1 }) end, { "token 2" }, "write_shard rejects negative tokens")
  t.raises(function() data.write_shard(P("bad.bin"), { 1.5 }) end, { "token 1" }, "write_shard rejects fractions")
  t.raises(function() data.write_shard(P("bad.bin"), ffi.new("uint16_t[2]")) end, { "n is required" }, "cdata needs n")
end

-- header validation errors
do
  local cases = {
    { "missing file", P("nope.bin"), { "cannot open shard", "nope.bin", "No such file" } },
    { "shorter than the header", write(P("short.bin"), header(20240520, 1, 0):sub(1, 100)),
      { "short.bin", "100 bytes", "1024-byte header" } },
    { "bad magic", write(P("magic.bin"), header(12345, 1, 0)), { "magic.bin", "bad magic 12345", "expected 20240520" } },
    { "bad version", write(P("version.bin"), header(20240520, 7, 0)), { "version.bin", "version 7", "expected 1" } },
    { "count beyond the file", write(P("count.bin"), header(20240520, 1, 100) .. ("\0"):rep(101)),
      { "count.bin", "header says 100 tokens", "holds only 50" } },
    { "negative count", write(P("neg.bin"), header(20240520, 1, -5)), { "neg.bin", "-5 tokens" } },
  }
  for _, c in ipairs(cases) do
    local err = t.raises(function() data.read_shard_header(c[2]) end, c[3], "shard header error: " .. c[1])
    t.ok(err and not err:find("\n"), "one-line error: " .. c[1])
    t.raises(function() data.TokenLoader { pattern = { c[2] }, batch = 1, ctx = 1 } end, { c[2] },
             "TokenLoader names the bad shard: " .. c[1])
  end
end

-- ======================= glob =======================

do
  os.execute("mkdir -p '" .. P("g") .. "'")
  for _, n in ipairs({ "train_000002.bin", "train_000000.bin", "train_000001.bin", "val_000000.bin",
                       ".train_hidden.bin", "train_x.txt" }) do
    write(P("g/" .. n), "")
  end
  local g = data.glob(P("g/train_*.bin"))
  t.eq(#g, 3, "glob: matches only train_*.bin, not hidden files")
  t.ok(g[1]:find("train_000000.bin$") and g[3]:find("train_000002.bin$"), "glob: sorted")
  t.eq(#data.glob(P("g/*_00000[01].bin")), 3, "glob: character class")
  t.eq(#data.glob(P("g/val_??????.bin")), 1, "glob: ?")
  t.eq(#data.glob(P("g/*.nothing")), 0, "glob: no match is empty")
  t.eq(data.glob(P("g/literal.bin"))[1], P("g/literal.bin"), "glob: no wildcard returns the path")
  t.raises(function() data.TokenLoader { pattern = P("g/*.nothing"), batch = 1, ctx = 1 } end,
           { "no files match", "*.nothing" }, "TokenLoader: empty glob")
end

-- ======================= TokenLoader =======================

-- Three shards whose token at global position k is k % 60000 (so a token
-- tells where it came from).
local shard_sizes = { 1000, 777, 1301 }
local shard_files, all = {}, {}
do
  local k = 0
  for s, n in ipairs(shard_sizes) do
    local toks = {}
    for i = 1, n do toks[i] = k % 60000; k = k + 1 end
    shard_files[s] = P(string.format("tok/train_%06d.bin", s - 1))
    os.execute("mkdir -p '" .. P("tok") .. "'")
    data.write_shard(shard_files[s], toks)
  end
  write(P("tok/val_000000.bin"), header(20240520, 1, 0))   -- must not be picked up by split=train
end

local function L(opts)
  opts.pattern = opts.pattern or P("tok/train_*.bin")
  opts.batch = opts.batch or 4
  opts.ctx = opts.ctx or 16
  return data.TokenLoader(opts)
end

local function batches(loader, n)
  local res = {}
  for i = 1, n do
    local x, y = loader:next()
    res[i] = { x:tolist(), y:tolist() }
  end
  return res
end

do
  local ld = L { }
  -- windows per shard: floor((n - 1) / (B*T)) with B*T = 64
  local expect = 0
  for _, n in ipairs(shard_sizes) do expect = expect + math.floor((n - 1) / 64) end
  t.eq(ld.n_windows, expect, "window count")
  t.eq(ld.batches_per_epoch, expect, "batches_per_epoch")
  t.eq(ld.n_tokens, 1000 + 777 + 1301, "n_tokens")

  local x, y = ld:next()
  t.all_near(x:shape(), { 4, 16 }, 0, "x shape (B, T)")
  t.all_near(y:shape(), { 4, 16 }, 0, "y shape (B, T)")
  t.eq(x:dtype(), "i64", "default dtype i64")
  local xs, ys = x:tolist(), y:tolist()
  t.eq(xs[1][1], 0, "first batch starts at token 0")
  t.eq(xs[4][16], 63, "first batch ends at token 63")
  local shifted = true
  for r = 1, 4 do
    for c = 1, 16 do
      local nxt = c < 16 and xs[r][c + 1] or (r < 4 and xs[r + 1][1] or 64)
      if ys[r][c] ~= nxt or ys[r][c] ~= xs[r][c] + 1 then shifted = false end
    end
  end
  t.ok(shifted, "y is x shifted by one token")

  -- In file order, windows walk shard 0 then shard 1 (never crossing).
  local firsts = { 0 }
  for i = 2, ld.n_windows do firsts[i] = ld:next():at(1, 1) end
  t.eq(firsts[15], 14 * 64, "last window of shard 0")
  t.eq(firsts[16], 1000, "shard 1 starts its own windows")
  t.eq(firsts[28], 1777, "shard 2 starts its own windows")
  local x2 = ld:next()
  t.eq(x2:at(1, 1), 0, "after an epoch, back to the first window")
  t.eq(ld:state().epoch, 1, "epoch counted")

  local d = L { split = "train", pattern = P("tok") }
  t.eq(d.n_windows, ld.n_windows, "directory + split=train finds train_*.bin only")
  t.raises(function() L { pattern = P("tok/train_*.bin"), split = "train" } end, "needs pattern to be a directory",
           "split with a glob")

  local i32 = L { dtype = "i32" }
  local xi = i32:next()
  t.eq(xi:dtype(), "i32", "dtype i32")
  t.eq(xi:at(2, 3), 18, "i32 values")
end

-- errors
do
  t.raises(function() L { batch = 8, ctx = 100 } end, { "train_000001.bin", "777 tokens", "fewer than batch*ctx+1", "801" },
           "shard with fewer than B*T+1 tokens names the shard")
  t.raises(function() L { batch = 6, world = 4 } end, { "batch 6", "not divisible by world 4" }, "B not divisible by W")
  t.raises(function() L { world = 2, rank = 2 } end, "rank 2 is not below world 2", "rank out of range")
  t.raises(function() L { batch = 0 } end, "batch must be an integer", "batch 0")
  t.raises(function() L { ctx = 2.5 } end, "ctx must be an integer", "fractional ctx")
  t.raises(function() L { dtype = "f32" } end, "dtype must be i64 or i32", "float dtype")
  t.raises(function() data.TokenLoader { pattern = 5, batch = 1, ctx = 1 } end, "pattern must be", "bad pattern")
end

-- shuffle determinism
do
  local a = batches(L { shuffle = true, seed = 7 }, 80)        -- more than two epochs
  local b = batches(L { shuffle = true, seed = 7 }, 80)
  local c = batches(L { shuffle = true, seed = 8 }, 80)
  local plain = batches(L { shuffle = false }, 40)
  t.ok(same(a, b), "same seed -> same batches")
  t.ok(not same(a, c), "different seed -> different batches")
  t.ok(not same({ a[1], a[2], a[3] }, { plain[1], plain[2], plain[3] }), "shuffled order differs from file order")

  -- each epoch is a permutation of all windows, reshuffled per epoch
  local ld = L { shuffle = true, seed = 7 }
  local n = ld.n_windows
  local function epoch_firsts()
    local seen, order = {}, {}
    for i = 1, n do
      local x = ld:next()
      local f = x:at(1, 1)
      seen[f] = true
      order[i] = f
    end
    local count = 0
    for _ in pairs(seen) do count = count + 1 end
    return count, order
  end
  local c1, o1 = epoch_firsts()
  local c2, o2 = epoch_firsts()
  t.eq(c1, n, "epoch 0 visits every window once")
  t.eq(c2, n, "epoch 1 visits every window once")
  t.ok(not same(o1, o2), "each epoch is reshuffled")

  for _, b0 in ipairs(a) do
    local xs, ys = b0[1], b0[2]
    local ok = true
    for r = 1, #xs do for col = 1, #xs[r] do if ys[r][col] ~= xs[r][col] + 1 then ok = false end end end
    if not ok then t.ok(false, "shuffled y is x shifted"); break end
  end

  -- the permutation itself
  local p1 = data._permutation(1000, 1, 0)
  local seen, okp = {}, true
  for i = 0, 999 do
    if seen[p1[i]] or p1[i] < 0 or p1[i] >= 1000 then okp = false end
    seen[p1[i]] = true
  end
  t.ok(okp, "permutation of 0..n-1")
end

-- rank/world slicing: the ranks' rows, concatenated, are the world-1 batch
for _, shuffle in ipairs({ false, true }) do
  local ref = batches(L { batch = 12, ctx = 8, shuffle = shuffle, seed = 3 }, 50)
  for _, W in ipairs({ 1, 2, 3, 4 }) do
    local per_rank = {}
    for r = 0, W - 1 do
      per_rank[r] = batches(L { batch = 12, ctx = 8, shuffle = shuffle, seed = 3, rank = r, world = W }, 50)
    end
    local ok, shape_ok = true, true
    for i = 1, 50 do
      local xs, ys = {}, {}
      for r = 0, W - 1 do
        local bx, by = per_rank[r][i][1], per_rank[r][i][2]
        if #bx ~= 12 / W then shape_ok = false end
        for _, row in ipairs(bx) do xs[#xs + 1] = row end
        for _, row in ipairs(by) do ys[#ys + 1] = row end
      end
      if not same(xs, ref[i][1]) or not same(ys, ref[i][2]) then ok = false end
    end
    t.ok(shape_ok, string.format("world %d: each rank gets batch/world rows (shuffle=%s)", W, tostring(shuffle)))
    t.ok(ok, string.format("world %d: ranks' rows concatenate to the world-1 batch (shuffle=%s)", W, tostring(shuffle)))
  end
end

-- state / set_state / reset
do
  local a = L { shuffle = true, seed = 11 }
  batches(a, 60)                                  -- into epoch 1
  local st = a:state()
  t.eq(st.epoch, 1, "state epoch")
  t.eq(st.index, 60 - a.n_windows, "state index")
  local rest = batches(a, 60)
  local b = L { shuffle = true, seed = 11 }
  b:set_state(st)
  t.ok(same(batches(b, 60), rest), "set_state resumes exactly (across epochs)")

  -- a state survives JSON (plain numbers)
  local json = require "fsdp.json"
  local c = L { shuffle = true, seed = 11 }
  c:set_state(json.decode(json.encode(st)))
  t.ok(same(batches(c, 5), { rest[1], rest[2], rest[3], rest[4], rest[5] }), "state through JSON")

  -- state at an epoch's end
  local d = L { shuffle = true, seed = 11 }
  batches(d, d.n_windows)
  local st2 = d:state()
  local want = batches(d, 3)
  local e = L { shuffle = true, seed = 11 }
  e:set_state(st2)
  t.ok(same(batches(e, 3), want), "set_state at the end of an epoch")

  e:reset()
  t.ok(same(batches(e, 3), batches(L { shuffle = true, seed = 11 }, 3)), "reset starts over")

  t.raises(function() e:set_state({ epoch = 0, index = 0, windows = 5 }) end, { "5 windows" }, "state for other data")
  t.raises(function() e:set_state({ epoch = 0, index = 0, seed = 12 }) end, { "seed 12" }, "state for another seed")
  t.raises(function() e:set_state({ epoch = -1, index = 0 }) end, "non-negative integers", "bad epoch")
  t.raises(function() e:set_state({ epoch = 0, index = 1e6 }) end, "beyond", "index beyond the epoch")
  e:close()
end

-- ======================= bytes =======================

local text = "The quick brown fox jumps over the lazy dog. " ..
             "Pack my box with five dozen liquor jugs! \n\tÉtude 123 — ok.\n"
text = text:rep(8)
local text_path = write(P("text.txt"), text)

do
  local enc = data.encode_bytes("hé\0\255")
  t.ok(same(enc, { 104, 195, 169, 0, 255 }), "encode_bytes")
  t.eq(data.decode_bytes(enc), "hé\0\255", "decode_bytes of a list")
  t.eq(data.decode_bytes({ 72, 300, -1, 105 }), "H??i", "decode_bytes replaces ids outside 0..255")
  t.eq(data.decode_bytes(fsdp.tensor({ { 72, 105 }, { 33, 10 } }, nil, { dtype = "i64" })), "Hi!\n", "decode_bytes of a tensor")
  t.eq(data.decode_bytes(fsdp.tensor({ 72, 105 }, nil, { dtype = "i32" })), "Hi", "decode_bytes of an i32 tensor")
  t.raises(function() data.decode_bytes(fsdp.tensor({ 1.5 })) end, "integer tensor", "decode_bytes of a float tensor")

  local B = data.ByteLoader { path = text_path, batch = 2, ctx = 32 }
  t.eq(B.n_tokens, #text, "ByteLoader: tokens are the bytes")
  t.eq(B.vocab, 256, "ByteLoader: vocab 256")
  local x, y = B:next()
  t.eq(data.decode_bytes(x), text:sub(1, 64), "ByteLoader: x is the text")
  t.eq(data.decode_bytes(y), text:sub(2, 65), "ByteLoader: y is the text shifted")
  local x2 = B:next()
  t.eq(data.decode_bytes(x2), text:sub(65, 128), "ByteLoader: windows advance by B*T")

  local S1 = batches(data.ByteLoader { path = text_path, batch = 2, ctx = 32, shuffle = true, seed = 5 }, 20)
  local S2 = batches(data.ByteLoader { path = text_path, batch = 2, ctx = 32, shuffle = true, seed = 5 }, 20)
  t.ok(same(S1, S2), "ByteLoader: deterministic shuffle")

  -- rank slicing holds here too
  local ref = batches(data.ByteLoader { path = text_path, batch = 4, ctx = 8, shuffle = true, seed = 2 }, 10)
  local r0 = batches(data.ByteLoader { path = text_path, batch = 4, ctx = 8, shuffle = true, seed = 2, rank = 0, world = 2 }, 10)
  local r1 = batches(data.ByteLoader { path = text_path, batch = 4, ctx = 8, shuffle = true, seed = 2, rank = 1, world = 2 }, 10)
  local ok = true
  for i = 1, 10 do
    local cat = { r0[i][1][1], r0[i][1][2], r1[i][1][1], r1[i][1][2] }
    if not same(cat, ref[i][1]) then ok = false end
  end
  t.ok(ok, "ByteLoader: rank slicing")

  local tr = data.ByteLoader { path = text_path, batch = 1, ctx = 8, split = "train", val_fraction = 0.25 }
  local va = data.ByteLoader { path = text_path, batch = 1, ctx = 8, split = "val", val_fraction = 0.25 }
  t.eq(tr.n_tokens + va.n_tokens, #text, "train + val cover the text")
  t.eq(va.n_tokens, math.floor(#text * 0.25 + 0.5), "val is val_fraction of the text")
  t.eq(data.decode_bytes(va:next()), text:sub(tr.n_tokens + 1, tr.n_tokens + 8), "val is the end of the text")

  t.raises(function() data.ByteLoader { path = P("none.txt"), batch = 1, ctx = 8 } end, { "none.txt", "cannot open" },
           "ByteLoader: missing file")
  t.raises(function() data.ByteLoader { path = text_path, batch = 64, ctx = 64 } end, { "text.txt", "fewer than batch*ctx+1" },
           "ByteLoader: text too short")
  t.raises(function() data.ByteLoader { path = text_path, batch = 1, ctx = 8, split = "test" } end, "split must be",
           "ByteLoader: bad split")
end

-- ======================= tools/make_shards.lua =======================

do
  local launcher = os.getenv("FSDP_TEST_LAUNCHER") or (arg and arg[-1])
  local root = (arg and arg[0] and arg[0]:match("^(.*/)tests/lua/")) or "./"
  local tool = root .. "tools/make_shards.lua"
  if launcher and io.open(tool, "rb") then
    local outdir = P("shards")
    local cmd = string.format("'%s' '%s' --input='%s' --out='%s' --val-fraction=0.2 --shard-tokens=300 2>&1",
                              launcher, tool, text_path, outdir)
    local p = io.popen(cmd)
    local log = p:read("*a")
    p:close()
    t.ok(log:find("train_000000.bin", 1, true) ~= nil, "make_shards prints what it wrote")
    local trains = data.glob(outdir .. "/train_*.bin")
    local vals = data.glob(outdir .. "/val_*.bin")
    local ntrain, nval = 0, 0
    local got = {}
    for _, f in ipairs(trains) do
      local toks, n = data.read_shard(f)
      t.ok(n <= 300, "make_shards: shard-tokens respected")
      ntrain = ntrain + n
      for i = 0, n - 1 do got[#got + 1] = string.char(toks[i]) end
    end
    for _, f in ipairs(vals) do
      local toks, n = data.read_shard(f)
      nval = nval + n
      for i = 0, n - 1 do got[#got + 1] = string.char(toks[i]) end
    end
    t.eq(#trains, math.ceil(ntrain / 300), "make_shards: train shard count")
    t.eq(nval, math.floor(#text * 0.2 + 0.5), "make_shards: val fraction")
    t.eq(table.concat(got), text, "make_shards: train then val shards hold the text's bytes")

    -- The shards and the text file give the same training data.
    local ta = data.ByteLoader { path = text_path, split = "train", val_fraction = 0.2, batch = 2, ctx = 16 }
    local first = data.TokenLoader { pattern = outdir, split = "train", batch = 2, ctx = 16 }
    t.ok(same(batches(first, 1), batches(ta, 1)), "make_shards output matches ByteLoader split=train")

    local p2 = io.popen(string.format("'%s' '%s' --input='%s' 2>&1; echo rc=$?", launcher, tool, text_path))
    local log2 = p2:read("*a")
    p2:close()
    t.ok(log2:find("--out=DIR is required", 1, true) and log2:find("rc=2", 1, true), "make_shards: usage error")
  else
    t.ok(false, "launcher or tools/make_shards.lua not found for the tool test")
  end
end

os.execute("rm -rf '" .. tmp .. "'")
t.done()
