-- Fuzzed safetensors files (bounded, seeded): a file of every dtype
-- (F32, BF16, I32, I64, U16; odd shapes, a zero-element tensor, metadata)
-- damaged --cases times: a bit or byte flipped anywhere, a digit of the
-- header changed, a byte cut from or added to the header (with and without
-- fixing its length), the length field moved, the file truncated or grown,
-- a header field changed and the header re-encoded. Every case is loaded in
-- this process (so a crash fails the test) and read again by an
-- independent reader (tests/fuzz/safetensors_ref.py, when /usr/bin/python3
-- is there). A load that succeeds must return exactly the tensors the
-- reference reads, byte for byte; one the reference refuses must fail.
--   fsdp-lua tests/fuzz/test_fuzz_safetensors.lua --cases=300 --seed=1
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local ffi = require "ffi"
local fsdp = require "fsdp"
local json = require "fsdp.json"
local fio = require "fsdp.io"
local st = require "fsdp.safetensors"

local opts = ... or {}
local ncases = tonumber(opts.cases or 300)
local seed = tonumber(opts.seed or 1)
local python = opts.python or "/usr/bin/python3"
local here = "tests/fuzz"

local state = seed * 2654435761 % 4294967296
local function rand(n)   -- 1..n
  state = (state * 1103515245 + 12345) % 2147483648
  return math.floor(state / 65536) % n + 1
end

local tmp = os.tmpname()
os.remove(tmp)
fio.mkdirs(tmp)

local base_path = tmp .. "/base.safetensors"
st.save(base_path, {
  a = fsdp.randn({ 3, 5 }, { seed = 1 }),
  b = fsdp.randn({ 7 }, { seed = 2 }):bf16(),
  c = fsdp.tensor({ { { 1, -2, 3 } }, { { 4, 5, -6 } } }, { dtype = "i32" }),
  d = fsdp.tensor({ 123456789012 }, { dtype = "i64" }),
  e = fsdp.tensor({ 0, 1, 65535, 7, 9 }, { dtype = "u16" }),
  z = fsdp.zeros({ 0, 4 }),
}, { note = "fuzz", step = 3 })
local base = fio.read_file(base_path)
local hlen = 0
for i = 8, 1, -1 do hlen = hlen * 256 + base:byte(i) end

local function le64(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end
local function replace_at(s, i, c) return s:sub(1, i - 1) .. c .. s:sub(i + 1) end
local function header_of(s) return s:sub(9, 8 + hlen) end
local function with_header(s, h, fix_len) return le64(fix_len and #h or hlen) .. h .. s:sub(9 + hlen) end

local edits = {
  bit = function(s)
    local i = rand(#s)
    return replace_at(s, i, string.char(bit.bxor(s:byte(i), bit.lshift(1, rand(8) - 1))))
  end,
  data_byte = function(s)   -- a valid file with other values
    local i = 8 + hlen + rand(#s - 8 - hlen)
    return replace_at(s, i, string.char(rand(256) - 1))
  end,
  header_digit = function(s)
    local h = header_of(s)
    local pos = {}
    for i = 1, #h do if h:sub(i, i):match("%d") then pos[#pos + 1] = i end end
    local i = pos[rand(#pos)]
    return with_header(s, replace_at(h, i, tostring((tonumber(h:sub(i, i)) + rand(9)) % 10)))
  end,
  header_char = function(s)
    local h = header_of(s)
    local chars = '{}[],:" 0123456789-.eE\\abFIU'
    local j = rand(#chars)
    return with_header(s, replace_at(h, rand(#h), chars:sub(j, j)))
  end,
  header_cut = function(s)
    local h = header_of(s)
    local i = rand(#h)
    return with_header(s, h:sub(1, i - 1) .. h:sub(i + 1), rand(2) == 1)
  end,
  header_add = function(s)
    local h = header_of(s)
    local i = rand(#h)
    return with_header(s, h:sub(1, i) .. (" x0,"):sub(rand(4), nil):sub(1, 1) .. h:sub(i + 1), rand(2) == 1)
  end,
  length = function(s)
    local d = ({ -8, -2, -1, 1, 2, 8 })[rand(6)]
    return le64(hlen + d) .. s:sub(9)
  end,
  length_huge = function(s) return le64(2 ^ 40 + rand(1000)) .. s:sub(9) end,
  truncate = function(s) return s:sub(1, rand(#s) - 1) end,
  grow = function(s) return s .. string.rep("\0", rand(9)) end,
  field = function(s)   -- one field of one entry changed, the header re-encoded
    local h = json.decode(header_of(s))
    local names = {}
    for k in pairs(h) do if k ~= "__metadata__" then names[#names + 1] = k end end
    table.sort(names)
    local e = h[names[rand(#names)]]
    local which = rand(6)
    if which == 1 then
      e.dtype = ({ "F32", "BF16", "I32", "I64", "U16", "F16", "u8" })[rand(7)]
    elseif which == 2 then
      if #e.shape > 0 then e.shape[rand(#e.shape)] = math.max(0, e.shape[rand(#e.shape)] + ({ -1, 1, 2 })[rand(3)]) end
    elseif which == 3 then
      e.data_offsets[rand(2)] = math.max(0, e.data_offsets[rand(2)] + ({ -4, -2, -1, 1, 2, 4 })[rand(6)])
    elseif which == 4 then
      local o = h[names[rand(#names)]]
      e.data_offsets, o.data_offsets = o.data_offsets, e.data_offsets
    elseif which == 5 then
      h[names[rand(#names)]] = nil
    else
      e.shape = json.array({ e.shape[1] or 1 })
    end
    local head = st.encode_header(h)
    return head .. s:sub(9 + hlen)
  end,
}
local edit_names = {}
for k in pairs(edits) do edit_names[#edit_names + 1] = k end
table.sort(edit_names)

-- each case: its file, its kind, and what this process's loader made of it
local cases = {}
local counts = { loaded = 0, refused = 0 }
for k = 1, ncases do
  local kind = edit_names[rand(#edit_names)]
  local path = string.format("%s/case_%04d.safetensors", tmp, k)
  local f = assert(io.open(path, "wb"))
  f:write(edits[kind](base))
  f:close()
  local ok, res = pcall(st.load, path, { device = "cpu" })
  local c = { path = path, kind = kind, ok = ok }
  if ok then
    counts.loaded = counts.loaded + 1
    c.tensors = {}
    for name, x in pairs(res) do
      local n = x:numel() * ({ f32 = 4, bf16 = 2, i32 = 4, i64 = 8, u16 = 2 })[x:dtype()]
      c.tensors[name] = { x:dtype(), x:shape(), n > 0 and ffi.string(x:data_ptr(), n) or "" }
    end
  else
    counts.refused = counts.refused + 1
    c.err = tostring(res)
    if not c.err:find(path, 1, true) then counts.unnamed = (counts.unnamed or 0) + 1 end
  end
  cases[k] = c
end

-- the independent reader
local have_python = io.open(python, "rb")
if have_python then have_python:close() end
local silent, refused_valid = 0, 0
if have_python then
  local list = tmp .. "/list.txt"
  local f = assert(io.open(list, "wb"))
  for _, c in ipairs(cases) do f:write(c.path, "\n") end
  f:close()
  local out = tmp .. "/ref.json"
  assert(os.execute(string.format("'%s' %s/safetensors_ref.py '%s' '%s'", python, here, list, out)) == 0
    or fio.stat(out) == "file", "the reference reader failed")
  local ref = json.decode(fio.read_file(out))
  local dt = { F32 = "f32", BF16 = "bf16", I32 = "i32", I64 = "i64", U16 = "u16" }
  for k, c in ipairs(cases) do
    local r = ref[k]
    local same = true
    if c.ok and not r.ok then
      same = false
    elseif c.ok then
      local file = fio.read_file(c.path)
      local n = 0
      for name, e in pairs(r.tensors) do
        n = n + 1
        local mine = c.tensors[name]
        if not mine or mine[1] ~= dt[e[1]] or table.concat(mine[2], ",") ~= table.concat(e[2], ",")
            or mine[3] ~= file:sub(e[3] + 1, e[4]) then
          same = false
        end
      end
      for _ in pairs(c.tensors) do n = n - 1 end
      if n ~= 0 then same = false end
    elseif r.ok then
      refused_valid = refused_valid + 1
      print(string.format("refused a file the reference reads: case %d (%s): %s", k, c.kind, c.err))
    end
    if not same then
      silent = silent + 1
      print(string.format("SILENT DIFFERENCE: case %d (%s), reference: %s", k, c.kind, r.ok and "ok" or r.why))
    end
  end
else
  print("fuzz.safetensors: " .. python .. " not found: no reference comparison")
end

print(string.format("fuzz.safetensors: %d cases (seed %d): %d refused with an error, %d loaded (%s), %d silent "
  .. "differences, %d valid files refused, 0 crashes", ncases, seed, counts.refused, counts.loaded,
  have_python and "each equal to the reference reading" or "no reference", silent, refused_valid))
t.eq(silent, 0, "no file loads differently from the reference reading")
t.eq(counts.unnamed or 0, 0, "every error names the file")
t.ok(counts.refused > ncases / 3 and counts.loaded > 0, "the cases include both outcomes")
fio.remove_tree(tmp)
t.done()
