-- Strict inputs on loads: state loads refuse integer tensors as float
-- weights (load_state_dict, GPT:from_hf) and leave the model as it was;
-- safetensors offsets must tile the data section exactly (a header length
-- off by one either way, a gap, trailing bytes: errors naming the file) and
-- the header must be UTF-8;
-- token shards must hold exactly the tokens their header counts.

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local ffi = require "ffi"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local st = require "fsdp.safetensors"
local data = require "fsdp.data"
local fio = require "fsdp.io"

local tmp = os.tmpname()
os.remove(tmp)
fio.mkdirs(tmp)
local function P(name) return tmp .. "/" .. name end

-- ======================= state loads =======================

do
  local cfg = { vocab_size = 11, n_layer = 1, n_head = 1, n_embd = 4, block_size = 3 }
  local m = nn.GPT(cfg):materialize { seed = 1 }
  local sd = {}
  for _, p in ipairs(m:named_parameters()) do sd[p.path] = p.tensor:clone() end
  local before = m:named_parameters()[1].tensor:view(-1):tolist()
  local path1 = m:named_parameters()[1].path
  for _, dt in ipairs({ "i64", "i32", "u16" }) do
    local bad = {}
    for k, v in pairs(sd) do bad[k] = v end
    bad[path1] = fsdp.zeros(sd[path1]:shape(), { dtype = dt })
    t.raises(function() m:load_state_dict(bad) end, { "load_state_dict", "'" .. path1 .. "'", dt, "f32" },
      "load_state_dict refuses " .. dt .. " for an f32 parameter")
  end
  t.all_near(m:named_parameters()[1].tensor:view(-1):tolist(), before, 0, "the refused load changed nothing")
  local bad = {}
  for k, v in pairs(sd) do bad[k] = v end
  bad[path1] = { 1, 2, 3 }
  t.raises(function() m:load_state_dict(bad) end, { "'" .. path1 .. "'", "is a table, not a tensor" },
    "load_state_dict refuses a table")
  -- bf16 weights are fine (converted)
  local half = {}
  for k, v in pairs(sd) do half[k] = v:bf16() end
  t.ok(pcall(m.load_state_dict, m, half), "load_state_dict takes bf16 tensors")

  local hf = m:to_hf(sd)
  hf["wte.weight"] = fsdp.zeros(hf["wte.weight"]:shape(), { dtype = "i64" })
  t.raises(function() m:from_hf(hf) end, { "GPT:from_hf", "'wte.weight'", "i64", "f32 or bf16" },
    "from_hf refuses an integer wte")
  local hf2 = m:to_hf(sd)
  hf2["h.0.attn.c_attn.weight"] = fsdp.zeros(hf2["h.0.attn.c_attn.weight"]:shape(), { dtype = "i32" })
  t.raises(function() m:from_hf(hf2) end, { "'h.0.attn.c_attn.weight'", "i32" }, "from_hf refuses an i32 weight")
  t.ok(pcall(m.from_hf, m, m:to_hf(sd)), "from_hf takes the model's own export")
end

-- ======================= safetensors: offsets tile the data =======================

local function le64(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end

local function write(name, bytes)
  fio.write_atomic(P(name), bytes)
  return P(name)
end

do
  local x = fsdp.tensor({ 1, 2, 3 })
  local y = fsdp.tensor({ { 4, 5 }, { 6, 7 } })
  local good = P("good.safetensors")
  st.save(good, { x = x, y = y })
  local bytes = fio.read_file(good)
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + bytes:byte(i) end
  local body = bytes:sub(9)
  t.all_near(st.load(good).y:view(-1):tolist(), { 4, 5, 6, 7 }, 0, "the saved file loads")
  local cases = {
    { "header length one short", write("short.safetensors", le64(n - 1) .. body) },
    { "header length one long", write("long.safetensors", le64(n + 1) .. body) },
    { "a byte after the data", write("trail.safetensors", bytes .. "\0") },
  }
  for _, c in ipairs(cases) do
    t.raises(function() st.load(c[2]) end, { "safetensors", c[2] }, c[1] .. ": an error naming the file")
    t.raises(function() st.read_header(c[2]) end, { c[2] }, c[1] .. ": read_header refuses it too")
  end
  t.raises(function() st.load(P("trail.safetensors")) end, { "belong to no tensor", "cover the data section" },
    "trailing bytes: the message says why")
  local hdr = '{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
  local gap = write("gap.safetensors", le64(#hdr) .. hdr .. ("\0"):rep(8))
  t.raises(function() st.load(gap) end, { "gap.safetensors", "data bytes [0, 4) belong to no tensor", '"a"' },
    "a hole before a tensor")
  local hdr2 = '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}'
  local gap2 = write("gap2.safetensors", le64(#hdr2) .. hdr2 .. ("\0"):rep(12))
  t.raises(function() st.load(gap2) end, { "gap2.safetensors", "[4, 8)", '"b"' }, "a hole between tensors")
  local hdr4 = '{"\250x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
  t.raises(function() st.load(write("utf8.safetensors", le64(#hdr4) .. hdr4 .. ("\0"):rep(4))) end,
    { "utf8.safetensors", "not UTF-8", "byte 3" }, "a header that is not UTF-8")
  local hdr5 = '{"\195\169":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
  t.ok(st.load(write("utf8ok.safetensors", le64(#hdr5) .. hdr5 .. ("\0"):rep(4)))["\195\169"] ~= nil,
    "a UTF-8 name loads")
  local hdr3 = '{"e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}'
  t.eq(st.load(write("empty.safetensors", le64(#hdr3) .. hdr3)).e:numel(), 0, "a zero-element tensor, no data")
end

-- ======================= token shards: exact size =======================

local function header(magic, version, n)
  local h = ffi.new("int32_t[256]")
  h[0], h[1], h[2] = magic, version, n
  return ffi.string(h, 1024)
end

do
  local ok = write("ok.bin", header(20240520, 1, 3) .. "\1\0\2\0\3\0")
  t.eq(data.read_shard_header(ok).ntok, 3, "an exact shard")
  local cases = {
    { "one byte too many", write("plus1.bin", header(20240520, 1, 3) .. "\1\0\2\0\3\0\0"),
      { "plus1.bin", "1031 bytes", "3 tokens", "1 bytes too many" } },
    { "one token too many", write("plus2.bin", header(20240520, 1, 3) .. "\1\0\2\0\3\0\4\0"),
      { "plus2.bin", "2 bytes too many" } },
    { "count beyond the file", write("minus.bin", header(20240520, 1, 4) .. "\1\0\2\0\3\0"),
      { "minus.bin", "says 4 tokens", "holds only 3" } },
    { "odd size", write("odd.bin", header(20240520, 1, 0) .. "\1"), { "odd.bin", "1 bytes too many" } },
    { "version 2 (uint32 tokens)", write("v2.bin", header(20240520, 2, 3) .. ("\0"):rep(12)),
      { "v2.bin", "version 2" } },
    { "magic", write("magic.bin", header(20240521, 1, 0)), { "magic.bin", "bad magic 20240521" } },
  }
  for _, c in ipairs(cases) do
    t.raises(function() data.read_shard_header(c[2]) end, c[3], "shard: " .. c[1])
    t.raises(function() data.read_shard(c[2]) end, { c[2] }, "read_shard: " .. c[1])
    t.raises(function() data.TokenLoader { pattern = { c[2] }, batch = 1, ctx = 1 } end, { c[2] },
      "TokenLoader: " .. c[1])
  end
end

fio.remove_tree(tmp)
t.done()
