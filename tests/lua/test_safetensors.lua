-- Tests for fsdp.json and fsdp.safetensors: round trips, exactness, and
-- every malformed-file error (files crafted byte by byte).

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local ffi = require "ffi"
local fsdp = require "fsdp"
local core = require "fsdp.core"
local json = require "fsdp.json"
local st = require "fsdp.safetensors"

local C = core.C

local tmp = os.tmpname()
os.remove(tmp)
assert(os.execute("mkdir -p '" .. tmp .. "'"))
local function P(name) return tmp .. "/" .. name end

local function deep_eq(a, b)
  if type(a) ~= type(b) then return false end
  if type(a) ~= "table" then
    if a ~= a and b ~= b then return true end
    return a == b
  end
  for k, v in pairs(a) do if not deep_eq(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

-- ======================= JSON =======================

do
  local v = {
    a = { 1, 2, 3, json.array({}) }, b = "text", c = true, d = false,
    e = { x = { y = { z = "deep" } } }, f = json.object({}), g = json.null,
    s = "quote\" backslash\\ slash/ nl\n tab\t cr\r ff\f bs\b ctl\1\31 del\127 utf8 é 日本 😀",
    ints = { 0, -1, 1, 2 ^ 31, -2 ^ 31, 2 ^ 53, -2 ^ 53, 123456789012345, 9007199254740991 },
    floats = { 0.1, 1 / 3, -2.5, 1e-300, 1.7976931348623157e308, 5e-324, 123.456e10 },
  }
  local s = json.encode(v)
  t.ok(deep_eq(json.decode(s), v), "json round trip (compact)")
  local s2 = json.encode(v, { indent = "  " })
  t.ok(s2:find("\n  \"a\": [", 1, true) ~= nil, "json pretty output is indented")
  t.ok(deep_eq(json.decode(s2), v), "json round trip (pretty)")
  t.eq(json.encode(json.decode(s)), s, "json encode(decode(s)) == s")
  t.eq(json.encode({ b = 1, a = 2, c = { z = 1, y = 2 } }), '{"a":2,"b":1,"c":{"y":2,"z":1}}', "keys sorted")
  t.eq(json.encode(2 ^ 53), "9007199254740992", "2^53 written exactly")
  t.eq(json.encode(-2 ^ 53), "-9007199254740992", "-2^53 written exactly")
  t.eq(json.decode("9007199254740991"), 9007199254740991, "2^53-1 read exactly")
  t.eq(json.decode("9007199254740992"), 2 ^ 53, "2^53 read exactly")
  t.eq(json.encode(ffi.new("int64_t", -9223372036854775807LL)), "-9223372036854775807", "int64 cdata exact")
  t.eq(json.encode(ffi.new("uint64_t", 18446744073709551615ULL)), "18446744073709551615", "uint64 cdata exact")
  t.eq(json.encode(-0.0), "0", "-0 as 0")
  t.eq(json.encode({}), "{}", "empty table is an object")
  t.eq(json.encode(json.array({})), "[]", "json.array marks an empty array")
  t.eq(json.encode(json.decode("[]")), "[]", "decoded empty array stays an array")
  t.eq(json.encode(json.decode("{}")), "{}", "decoded empty object stays an object")
  t.eq(json.decode('"\\u00e9\\ud83d\\ude00\\/"'), "é😀/", "\\u escapes and surrogate pairs")
  t.eq(json.decode('  {"a" : [ 1 , 2 ] }  ').a[2], 2, "whitespace")
  t.eq(json.decode("-1.5e+2"), -150, "exponent")
  t.eq(json.decode("null"), json.null, "null sentinel")
  t.eq(json.decode("[1,null,3]")[3], 3, "null keeps array positions")
  t.eq(json.decode('"\127"'), "\127", "raw DEL allowed in strings")
end

-- decode errors name the position
do
  local cases = {
    { '{"a":1,}', "position 8" }, { "[1 2]", "position 4" }, { "01", "leading zero" },
    { '"abc', "unterminated string" }, { '{"a" 1}', "position 6" }, { "tru", "position 1" },
    { "[1]x", "trailing" }, { "", "end of input" }, { "1.", "position 2" }, { "-", "malformed number" },
    { '"\\x"', "bad escape" }, { '{"a":1,"a":2}', "duplicate key" }, { '"\\ud800"', "surrogate" },
    { '"a\nb"', "control character" }, { "[1,\n  2,\n  @]", "line 3, column 3" }, { "1e", "exponent" },
    { "[" .. ("["):rep(600), "deeper" }, { "{1:2}", "string key" }, { '"\\u12g4"', "hex" },
  }
  for _, c in ipairs(cases) do
    t.raises(function() json.decode(c[1]) end, { "json.decode", c[2] }, "json.decode error: " .. c[1]:sub(1, 20))
  end
  t.raises(function() json.encode({ 0 / 0 }) end, { "nan", "$[1]" }, "encode NaN")
  t.raises(function() json.encode({ a = { 1 / 0 } }) end, { "inf", "$.a[1]" }, "encode inf names the path")
  local cyc = {}
  cyc.self = cyc
  t.raises(function() json.encode(cyc) end, "contains itself", "encode cycle")
  t.raises(function() json.encode({ f = print }) end, "function", "encode function")
  t.raises(function() json.encode({ [1] = 1, [3] = 3 }) end, "keys must be strings", "encode holes")
end

-- ======================= safetensors round trip =======================

local ctypes = { [0] = "float", "uint16_t", "int32_t", "int64_t", "uint16_t" }
local esize = { [0] = 4, 2, 4, 8, 2 }

-- A tensor of dtype id dt and shape, with values v(i) (i 0-based) stored raw.
local function make(dt, shape, v)
  local n = 1
  for _, d in ipairs(shape) do n = n * d end
  local buf = ffi.new(ctypes[dt] .. "[?]", n > 0 and n or 1)
  for i = 0, n - 1 do buf[i] = v(i) end
  local dims = ffi.new("int64_t[8]")
  for i, d in ipairs(shape) do dims[i - 1] = d end
  assert(C.fsdp_tensor_from_data(core.out, dt, #shape, dims, buf, n * esize[dt], 0, 5) == 0,
         ffi.string(C.fsdp_last_error()))
  return core.wrap()
end

-- The raw contiguous bytes of a tensor: compares values exactly (NaN payloads too).
local function raw(x)
  local n = x:numel()
  local nbytes = n * esize[core.dtype_id(x:dtype())]
  local buf = ffi.new("uint8_t[?]", nbytes > 0 and nbytes or 1)
  assert(C.fsdp_tensor_to_data(x, buf, nbytes) == 0)
  return ffi.string(buf, nbytes)
end

local shapes = { {}, { 1 }, { 7 }, { 3, 5, 2 }, { 1, 1, 1 }, { 2, 0, 3 }, { 13, 1 }, { 2, 3, 1, 2, 1, 2 } }
local gens = {
  [0] = function(i) return ({ 0.1, -3.5e38, 1e-40, 3.14159, -0.0, 1 / 0, -1 / 0, 0 / 0 })[i % 8 + 1] * (i + 1) end,
  [1] = function(i) return ({ 0x3F80, 0xBF81, 0x7F80, 0x7FC1, 0x0001, 0xFFFF, 0x8000 })[i % 7 + 1] end,
  [2] = function(i) return ({ -2147483648, 2147483647, 0, -1, 12345 })[i % 5 + 1] + (i % 5 == 2 and i or 0) end,
  [3] = function(i)
    return ({ ffi.new("int64_t", 9223372036854775807LL), ffi.new("int64_t", -9223372036854775807LL - 1),
              ffi.new("int64_t", 9007199254740993LL), -1, 0, 42 })[i % 6 + 1]
  end,
  [4] = function(i) return ({ 0, 65535, 32768, 1, 255 })[i % 5 + 1] end,
}

do
  local tensors, count = {}, 0
  for dt = 0, 4 do
    for k, shape in ipairs(shapes) do
      tensors[string.format("%s.shape%d", core.dtype_names[dt], k)] = make(dt, shape, gens[dt])
      count = count + 1
    end
  end
  local meta = { step = "100", note = "quote\" nl\n é 😀", empty = "", ["key with spaces"] = "v" }
  local path = P("all.safetensors")
  st.save(path, tensors, meta)

  local h = st.read_header(path)
  t.eq(#h.names, count, "read_header: every tensor listed")
  t.eq(h.data_start % 8, 0, "data section starts 8-aligned (header padded)")
  t.eq(h.header_bytes % 8, 0, "header length a multiple of 8")
  local sorted = true
  for i = 2, #h.names do if h.names[i - 1] >= h.names[i] then sorted = false end end
  t.ok(sorted, "read_header: names sorted")
  t.eq(h.tensors["bf16.shape4"].dtype, "BF16", "read_header: dtype")
  t.all_near(h.tensors["i64.shape4"].shape, { 3, 5, 2 }, 0, "read_header: shape")
  t.eq(#h.tensors["f32.shape1"].shape, 0, "read_header: 0-dim shape is empty")
  t.eq(h.tensors["f32.shape6"].nbytes, 0, "read_header: empty tensor has no bytes")
  t.ok(deep_eq(h.metadata, meta), "read_header: metadata")

  -- Offsets follow the sorted names, packed.
  local pos, packed = 0, true
  for _, nm in ipairs(h.names) do
    local e = h.tensors[nm]
    if e.offsets[1] ~= pos then packed = false end
    pos = e.offsets[2]
  end
  t.ok(packed, "data packed in name order")
  t.eq(h.data_start + pos, h.file_bytes, "file ends with the last tensor")

  local function check_all(loaded, what)
    for name, x in pairs(tensors) do
      local y = loaded[name]
      if not t.ok(y ~= nil, what .. ": " .. name .. " present") then break end
      t.eq(y:dtype(), x:dtype(), what .. ": " .. name .. " dtype")
      t.all_near(y:shape(), x:shape(), 0, what .. ": " .. name .. " shape")
      t.ok(raw(y) == raw(x), what .. ": " .. name .. " values bit-exact")
    end
  end

  local loaded, m2 = st.load(path)
  check_all(loaded, "load")
  t.ok(deep_eq(m2, meta), "load: metadata round trip")
  t.eq(loaded["f32.shape1"]:dim(), 0, "0-dim scalar stays 0-dim")
  t.eq(loaded["i32.shape2"]:numel(), 1, "1-element tensor")
  t.eq(loaded["u16.shape1"]:item(), 0, "u16 scalar value")
  t.eq(loaded["u16.shape3"]:at(2), 65535, "u16 max value")

  -- Chunked reads (the path large tensors take) give the same bytes.
  local saved = st.chunk_bytes
  st.chunk_bytes = 5
  check_all(st.load(path), "chunked load")
  st.chunk_bytes = saved

  -- Determinism: the same tensors give the same file.
  local path2 = P("again.safetensors")
  st.save(path2, tensors, meta)
  local f1, f2 = io.open(path, "rb"), io.open(path2, "rb")
  t.ok(f1:read("*a") == f2:read("*a"), "save is deterministic")
  f1:close(); f2:close()

  local sub = st.load(path, { names = { "i64.shape4", "bf16.shape1" } })
  local n = 0
  for _ in pairs(sub) do n = n + 1 end
  t.eq(n, 2, "load names= loads only those")
  t.raises(function() st.load(path, { names = { "nope" } }) end, { path, "no tensor named \"nope\"" }, "load missing name")
end

do -- no metadata, numbers in metadata, non-contiguous input, tags
  local x = fsdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
  local path = P("nc.safetensors")
  st.save(path, { xt = x:transpose(1, 2), x = x })
  local l, m = st.load(path, { tag = "param" })
  t.ok(next(m) == nil, "no metadata loads as an empty table")
  t.all_near(l.xt:tolist(), { { 1, 4 }, { 2, 5 }, { 3, 6 } }, 0, "non-contiguous tensor saved in logical order")
  t.eq(l.x:tag(), "param", "load tag option")
  st.save(path, { x = x }, { lr = 0.001, ok = true, n = 3 })
  local _, m2 = st.load(path)
  t.eq(m2.lr, "0.001", "number metadata as string")
  t.eq(m2.ok, "true", "boolean metadata as string")
  t.eq(m2.n, "3", "integer metadata as string")
  st.save(path, {}, {})
  local e, m3 = st.load(path)
  t.ok(next(e) == nil and next(m3) == nil, "empty file round trip")

  t.raises(function() st.save(path, { a = 1 }) end, { path, "not a tensor" }, "save non-tensor")
  t.raises(function() st.save(path, { [1] = x }) end, { path, "bad tensor name" }, "save non-string name")
  t.raises(function() st.save(path, { __metadata__ = x }) end, { path, "bad tensor name" }, "save reserved name")
  t.raises(function() st.save(path, { x = x }, { a = {} }) end, { path, "metadata" }, "save table metadata")
  t.raises(function() st.save(P("no/such/dir/f.safetensors"), { x = x }) end, { "no/such/dir", "cannot open" },
           "save into a missing directory")
end

-- ======================= malformed files =======================

local function le64(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end

local function write(name, bytes)
  local path = P(name)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  return path
end

-- A file with this header text and data; len overrides the length field.
local function craft(name, header, data, len)
  return write(name, (len and le64(len) or le64(#header)) .. header .. (data or ""))
end

local f32x2 = ffi.string(ffi.new("float[2]", 1, 2), 8)

do
  local ok = craft("ok.safetensors", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', f32x2)
  t.all_near(st.load(ok).a:tolist(), { 1, 2 }, 0, "a hand-crafted file loads")

  local cases = {
    { "missing", P("missing.safetensors"), { "cannot open", "No such file" } },
    { "shorter than 8 bytes", write("short.safetensors", "\5\0\0\0\0"), { "5 bytes", "shorter than the 8-byte" } },
    { "empty file", write("empty.safetensors", ""), { "0 bytes" } },
    { "header length beyond the file", craft("len.safetensors", "{}", "", 1000), { "header length 1000", "beyond the file" } },
    { "huge header length", write("huge.safetensors", "\255\255\255\255\255\255\255\127{}"), { "beyond the file" } },
    { "header not JSON", craft("json.safetensors", '{"a":{"dtype":"F32",'), { "not valid JSON", "position" } },
    { "header not an object", craft("arr.safetensors", "[1,2]"), { "not a JSON object" } },
    { "header is null", craft("null.safetensors", "null"), { "not a JSON object" } },
    { "metadata null", craft("mnull.safetensors", '{"__metadata__":null}'), { "__metadata__ is not a JSON object" } },
    { "entry null", craft("enull.safetensors", '{"a":null}'), { '"a"', "not a JSON object" } },
    { "entry not an object", craft("ent.safetensors", '{"a":5}'), { '"a"', "not a JSON object" } },
    { "unknown dtype", craft("dt.safetensors", '{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}', "\0\0\0\0"),
      { '"a"', "unknown dtype F16" } },
    { "missing dtype", craft("nodt.safetensors", '{"a":{"shape":[2],"data_offsets":[0,8]}}', f32x2), { "dtype missing" } },
    { "shape not an array", craft("shp.safetensors", '{"a":{"dtype":"F32","shape":{},"data_offsets":[0,8]}}', f32x2),
      { "shape missing or not an array" } },
    { "negative shape", craft("neg.safetensors", '{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', f32x2),
      { "not a non-negative integer" } },
    { "fractional shape", craft("frac.safetensors", '{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}}', f32x2),
      { "not a non-negative integer" } },
    { "shape/offsets disagree with dtype size",
      craft("size.safetensors", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', f32x2),
      { '"a"', "span 4 bytes", "needs 8" } },
    { "offsets reversed", craft("rev.safetensors", '{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}', f32x2),
      { "end before they begin" } },
    { "offsets not two integers", craft("offs.safetensors", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}}', f32x2),
      { "data_offsets must be" } },
    { "offsets beyond the file",
      craft("beyond.safetensors", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', f32x2),
      { '"a"', "beyond the file" } },
    { "overlapping",
      craft("overlap.safetensors", '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},' ..
                                   '"b":{"dtype":"I32","shape":[1],"data_offsets":[4,8]}}', f32x2),
      { "overlap", '"a"', '"b"' } },
    { "truncated data",
      craft("trunc.safetensors", '{"a":{"dtype":"I64","shape":[3],"data_offsets":[0,24]}}', ("\1"):rep(20)),
      { '"a"', "truncated" } },
    { "metadata not strings", craft("meta.safetensors", '{"__metadata__":{"k":1}}'), { "__metadata__", "must be strings" } },
    { "metadata not an object", craft("meta2.safetensors", '{"__metadata__":[1]}'), { "__metadata__ is not a JSON object" } },
  }
  for _, c in ipairs(cases) do
    local name, path, needles = c[1], c[2], c[3]
    local all = { "safetensors", path }
    for _, n in ipairs(needles) do all[#all + 1] = n end
    t.raises(function() st.load(path) end, all, "load error: " .. name)
    t.raises(function() st.read_header(path) end, { path }, "read_header error: " .. name)
  end

  -- A valid file cut short anywhere fails cleanly.
  local good = P("all.safetensors")
  local f = io.open(good, "rb")
  local bytes = f:read("*a")
  f:close()
  local clean = true
  for _, cut in ipairs({ 0, 3, 7, 8, 9, 50, #bytes - 100, #bytes - 1 }) do
    local p = write("cut.safetensors", bytes:sub(1, cut))
    local okc, err = pcall(st.load, p)
    if okc or not tostring(err):find(p, 1, true) then clean = false end
  end
  t.ok(clean, "every truncation of a valid file raises an error naming it")
end

os.execute("rm -rf '" .. tmp .. "'")
t.done()
