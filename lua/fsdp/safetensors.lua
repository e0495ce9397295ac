-- fsdp.safetensors: reading and writing the safetensors format.
--
-- Layout: an 8-byte little-endian header length N, N bytes of JSON
--   { "name": { "dtype": "F32", "shape": [2, 3], "data_offsets": [b, e] }, ...,
--     "__metadata__": { "key": "value", ... } }
-- then the raw little-endian data; offsets count from the start of the data.
--
--   local st = require "fsdp.safetensors"
--   st.save("w.safetensors", { wte = t1, ["h.0.w"] = t2 }, { step = "100" })
--   local tensors, meta = st.load("w.safetensors")
--   local h = st.read_header("w.safetensors")   -- names, dtypes, shapes; no data
--
-- A file is checked in full before any data is read, and every problem is a
-- Lua error naming the file: a truncated or hostile file never crashes the
-- process or makes it allocate what the header claims. The tensors' offsets
-- must tile the data section exactly (no gap, no overlap, nothing after).

local ffi = require "ffi"
local core = require "fsdp.core"
local json = require "fsdp.json"
local fio = require "fsdp.io"
require "fsdp.tensor"          -- the metatype: tensors we make get their methods

local C = core.C
local raise = core.raise
local out, wrap = core.out, core.wrap
local fmt, byte, concat, sort = string.format, string.byte, table.concat, table.sort
local floor, tonumber, type = math.floor, tonumber, type

local M = {}

-- Above this many bytes a tensor is read in chunks straight into its storage
-- rather than through one Lua string (LuaJIT strings top out near 2 GiB).
M.chunk_bytes = 64 * 1024 * 1024

-- safetensors dtype name <-> engine dtype id, element size.
local st_to_id = { F32 = 0, BF16 = 1, I32 = 2, I64 = 3, U16 = 4 }
local id_to_st = { [0] = "F32", "BF16", "I32", "I64", "U16" }
local elem_size = { [0] = 4, 2, 4, 8, 2 }
M.dtypes = st_to_id

-- One out-box per call site: with a single box shared by the dtype and
-- ndim calls in describe(), LuaJIT 2.1.0-beta3 (Debian 12) now and then
-- compiled a trace that read the ndim into the dtype (about one process
-- in five; seen as a u16 tensor saved as I64). Separate boxes never did.
local int_box = ffi.new("int[1]")
local dt_box = ffi.new("int[1]")
local nd_box = ffi.new("int[1]")
local i64_box = ffi.new("int64_t[1]")
local ptr_box = ffi.new("void *[1]")
local cptr_box = ffi.new("const void *[1]")
local dims8 = ffi.new("int64_t[8]")

local function fail(path, msg)
  raise("safetensors: " .. tostring(path) .. ": " .. msg)
end

local function is_uint(v)
  return type(v) == "number" and v >= 0 and v == floor(v) and v < 2 ^ 53
end

-- 8 bytes little-endian as a double (exact below 2^53; larger values are
-- beyond any file anyway and only need to compare as large).
local function le_u64(s)
  local v = 0
  for i = 8, 1, -1 do v = v * 256 + byte(s, i) end
  return v
end

local function le_u64_bytes(n)
  local b = {}
  for i = 1, 8 do
    b[i] = string.char(n % 256)
    n = floor(n / 256)
  end
  return concat(b)
end

local function open_read(path)
  if type(path) ~= "string" then raise("safetensors: path must be a string, got " .. type(path)) end
  local why = require("fsdp.io").file_problem(path)   -- a FIFO would hang io.open
  if why then fail(path, why) end
  local f, err = io.open(path, "rb")
  if not f then
    err = tostring(err)
    if err:sub(1, #path + 2) == path .. ": " then err = err:sub(#path + 3) end
    fail(path, "cannot open: " .. err)
  end
  return f
end

-- The position of the first byte of s that is not well-formed UTF-8
-- (overlong forms, surrogates and code points above U+10FFFF included), or nil.
local function utf8_error(s)
  if not s:find("[\128-\255]") then return nil end
  local i, n = 1, #s
  while i <= n do
    local c = byte(s, i)
    if c < 0x80 then
      i = i + 1
    else
      local len, lo, hi = 0, 0x80, 0xBF   -- continuation count; allowed range of the second byte
      if c >= 0xC2 and c <= 0xDF then len = 1
      elseif c == 0xE0 then len, lo = 2, 0xA0
      elseif c == 0xED then len, hi = 2, 0x9F
      elseif c >= 0xE1 and c <= 0xEF then len = 2
      elseif c == 0xF0 then len, lo = 3, 0x90
      elseif c >= 0xF1 and c <= 0xF3 then len = 3
      elseif c == 0xF4 then len, hi = 3, 0x8F
      else return i end
      for k = 1, len do
        local d = byte(s, i + k)
        if not d then return i end
        if k == 1 then
          if d < lo or d > hi then return i end
        elseif d < 0x80 or d > 0xBF then
          return i
        end
      end
      i = i + len + 1
    end
  end
  return nil
end

-- Reads and checks the header of an open file. Returns
-- { path, names (sorted), tensors = {name = {dtype, shape, offsets, numel,
--   nbytes}}, metadata, header_bytes, data_start, file_bytes }.
local function parse_header(f, path)
  local size = f:seek("end")
  f:seek("set", 0)
  if size < 8 then
    fail(path, fmt("file is %d bytes, shorter than the 8-byte header length", size))
  end
  local n = le_u64(f:read(8))
  if n > size - 8 then
    fail(path, fmt("header length %.0f is beyond the file (%d bytes after the length field)", n, size - 8))
  end
  local text = n > 0 and f:read(n) or ""
  if #text ~= n then fail(path, fmt("header truncated: read %d of %d bytes", #text, n)) end
  local bad_at = utf8_error(text)
  if bad_at then fail(path, fmt("header is not UTF-8 (byte %d of the header)", bad_at)) end
  local ok, hdr = pcall(json.decode, text)
  if not ok then fail(path, "header is not valid JSON: " .. tostring(hdr)) end
  if not json.is_object(hdr) then
    fail(path, "header is not a JSON object")
  end

  local data_bytes = size - 8 - n
  local info = {
    path = path, names = {}, tensors = {}, metadata = {},
    header_bytes = n, data_start = 8 + n, file_bytes = size,
  }

  local meta = hdr.__metadata__
  if meta ~= nil then
    if not json.is_object(meta) then
      fail(path, "__metadata__ is not a JSON object")
    end
    for k, v in pairs(meta) do
      if type(v) ~= "string" then
        fail(path, fmt("__metadata__[%q] is a %s (values must be strings)", k, v == json.null and "null" or type(v)))
      end
      info.metadata[k] = v
    end
  end

  local ranges = {}
  for name, e in pairs(hdr) do
    if name ~= "__metadata__" then
      local what = fmt("tensor %q", name)
      if not json.is_object(e) then fail(path, what .. ": entry is not a JSON object") end
      local dt = e.dtype
      local id = st_to_id[dt]
      if type(dt) ~= "string" then fail(path, what .. ": dtype missing or not a string") end
      if not id then
        fail(path, what .. ": unknown dtype " .. dt .. " (supported: F32, BF16, I32, I64, U16)")
      end
      local shape = e.shape
      if type(shape) ~= "table" or not json.is_array(shape) then
        fail(path, what .. ": shape missing or not an array")
      end
      if #shape > 8 then fail(path, what .. fmt(": %d dims (at most 8)", #shape)) end
      local numel = 1
      for i = 1, #shape do
        if not is_uint(shape[i]) then
          fail(path, what .. ": shape entry " .. tostring(shape[i]) .. " is not a non-negative integer")
        end
        numel = numel * shape[i]
      end
      local offs = e.data_offsets
      if type(offs) ~= "table" or not json.is_array(offs) or #offs ~= 2 or not is_uint(offs[1]) or not is_uint(offs[2]) then
        fail(path, what .. ": data_offsets must be an array of two non-negative integers")
      end
      local b, en = offs[1], offs[2]
      if en < b then fail(path, what .. fmt(": data_offsets [%d, %d] end before they begin", b, en)) end
      local nbytes = numel * elem_size[id]
      if en - b ~= nbytes then
        fail(path, what .. fmt(": data_offsets [%d, %d] span %d bytes but shape [%s] of %s needs %d",
                               b, en, en - b, concat(shape, ","), dt, nbytes))
      end
      if en > data_bytes then
        fail(path, what .. fmt(": data_offsets [%d, %d] are beyond the file (truncated data: the data section holds %d bytes)",
                               b, en, data_bytes))
      end
      local dims = {}
      for i = 1, #shape do dims[i] = shape[i] end
      info.tensors[name] = { dtype = dt, dtype_id = id, shape = dims, offsets = { b, en },
                             numel = numel, nbytes = nbytes }
      info.names[#info.names + 1] = name
      if nbytes > 0 then ranges[#ranges + 1] = { b, en, name } end
    end
  end
  sort(info.names)

  sort(ranges, function(x, y) return x[1] < y[1] or (x[1] == y[1] and x[3] < y[3]) end)
  for i = 2, #ranges do
    local p, q = ranges[i - 1], ranges[i]
    if q[1] < p[2] then
      fail(path, fmt("tensors %q [%d, %d] and %q [%d, %d] overlap", p[3], p[1], p[2], q[3], q[1], q[2]))
    end
  end
  -- the tensors tile the data section exactly (the format allows no holes):
  -- a header length that is off shifts the section and shows up here
  local at = 0
  for _, r in ipairs(ranges) do
    if r[1] ~= at then
      fail(path, fmt("data bytes [%d, %d) belong to no tensor (before %q): the offsets must cover the data "
        .. "section exactly (a wrong header length?)", at, r[1], r[3]))
    end
    at = r[2]
  end
  if at ~= data_bytes then
    fail(path, fmt("data bytes [%d, %d) at the end belong to no tensor: the offsets must cover the data section "
      .. "(%d bytes after the %d-byte header) exactly (a wrong header length, or trailing bytes?)", at, data_bytes,
      data_bytes, n))
  end
  return info
end

--- safetensors.read_header(path) -> info: { names = {sorted}, tensors =
-- {name = {dtype = "F32", shape = {..}, offsets = {b, e}, numel, nbytes}},
-- metadata = {..}, header_bytes, data_start, file_bytes }. Reads no data.
function M.read_header(path)
  local f = open_read(path)
  local ok, res = pcall(parse_header, f, path)
  f:close()
  if not ok then error(res, 0) end
  return res
end

local function int64s(list)
  local a = ffi.new("int64_t[?]", #list > 0 and #list or 1)
  for i = 1, #list do a[i - 1] = list[i] end
  return a
end

-- Reads one tensor's bytes from f into a new tensor.
local function read_tensor(f, info, name, e, dev, tag)
  local shape = int64s(e.shape)
  local nd = #e.shape
  f:seek("set", info.data_start + e.offsets[1])
  local n = e.nbytes
  if n <= M.chunk_bytes then
    local s = n > 0 and f:read(n) or ""
    if #s ~= n then fail(info.path, fmt("truncated data for tensor %q: read %d of %d bytes", name, #s, n)) end
    if C.fsdp_tensor_from_data(out, e.dtype_id, nd, shape, s, n, dev, tag) ~= 0 then raise() end
    return wrap()
  end
  -- Large: read in chunks straight into a host tensor's storage.
  if C.fsdp_tensor_empty(out, e.dtype_id, nd, shape, 0, tag) ~= 0 then raise() end
  local host = wrap()
  if C.fsdp_tensor_data_ptr(host, ptr_box) ~= 0 then raise() end
  local dst = ffi.cast("uint8_t *", ptr_box[0])
  local done = 0
  while done < n do
    local want = math.min(M.chunk_bytes, n - done)
    local s = f:read(want)
    if not s or #s ~= want then
      fail(info.path, fmt("truncated data for tensor %q: read %d of %d bytes", name, done + (s and #s or 0), n))
    end
    ffi.copy(dst + done, s, want)
    done = done + want
  end
  if dev == 0 then return host end
  if C.fsdp_tensor_empty(out, e.dtype_id, nd, shape, dev, tag) ~= 0 then raise() end
  local t = wrap()
  if C.fsdp_copy(t, host) ~= 0 then raise() end
  return t
end

--- safetensors.load(path, opts) -> {name = Tensor}, metadata.
-- opts: device ("cpu"), tag (memory tag, "other"), names (a list: load only
-- these; a missing name is an error).
function M.load(path, opts)
  local dev = core.device_id(opts and opts.device)
  local tag = core.tag_id(opts and opts.tag, 5)
  local f = open_read(path)
  local ok, res, meta = pcall(function()
    local info = parse_header(f, path)
    local names = info.names
    if opts and opts.names then
      names = opts.names
      for _, nm in ipairs(names) do
        if not info.tensors[nm] then fail(path, fmt("no tensor named %q", tostring(nm))) end
      end
    end
    local tensors = {}
    for _, nm in ipairs(names) do
      tensors[nm] = read_tensor(f, info, nm, info.tensors[nm], dev, tag)
    end
    return tensors, info.metadata
  end)
  f:close()
  if not ok then error(res, 0) end
  return res, meta
end

-- What save needs from a tensor: dtype id, shape, nbytes.
local function describe(t, name, path)
  if not ffi.istype(core.tensor_ptr, t) then
    raise(fmt("safetensors.save: %s: tensor %q is a %s, not a tensor", tostring(path), name, type(t)))
  end
  core.T(t, "safetensors.save: tensor " .. name)
  if C.fsdp_tensor_dtype(t, dt_box) ~= 0 then raise() end
  local id = dt_box[0]
  if C.fsdp_tensor_ndim(t, nd_box) ~= 0 then raise() end
  local nd = nd_box[0]
  if C.fsdp_tensor_shape(t, dims8) ~= 0 then raise() end
  if C.fsdp_tensor_numel(t, i64_box) ~= 0 then raise() end
  local shape = json.array({})
  for i = 1, nd do shape[i] = tonumber(dims8[i - 1]) end
  return id, shape, tonumber(i64_box[0]) * elem_size[id]
end

-- Writes t's bytes (contiguous, row-major) to f: straight from storage
-- when the tensor is a contiguous host tensor, else through a copy.
local function write_tensor(f, t, nbytes)
  if nbytes == 0 then return end
  local src, anchor
  if C.fsdp_tensor_is_contiguous(t, int_box) == 0 and int_box[0] ~= 0 and
     C.fsdp_tensor_read_ptr(t, cptr_box) == 0 then
    src = ffi.cast("const uint8_t *", cptr_box[0])
  else
    anchor = ffi.new("uint8_t[?]", nbytes)
    if C.fsdp_tensor_to_data(t, anchor, nbytes) ~= 0 then raise() end
    src = anchor
  end
  local done = 0
  while done < nbytes do
    local n = math.min(M.chunk_bytes, nbytes - done)
    f:append(src + done, n)
    done = done + n
  end
  return anchor   -- keeps the copy alive until the writes are done
end

--- The bytes a file starts with, for a header table {name = {dtype=,
-- shape=, data_offsets=}, __metadata__ = ...}: the 8-byte length and the
-- JSON, padded with spaces so that the data starts 8-aligned.
function M.encode_header(hdr)
  local text = json.encode(hdr)
  text = text .. string.rep(" ", (8 - #text % 8) % 8)
  return le_u64_bytes(#text) .. text
end

--- safetensors.save(path, {name = Tensor, ...}, metadata)
-- Names are written sorted and the data packed in that order, so equal
-- inputs give equal files. metadata values must be strings (numbers and
-- booleans are converted). The file is written beside path, synced and
-- renamed over it, so a crash never leaves a half-written file under the name.
function M.save(path, tensors, metadata)
  if type(path) ~= "string" then raise("safetensors.save: path must be a string, got " .. type(path)) end
  if type(tensors) ~= "table" then
    raise(fmt("safetensors.save: %s: tensors must be a table {name = tensor}, got %s", path, type(tensors)))
  end
  local names = {}
  for name in pairs(tensors) do
    if type(name) ~= "string" or name == "" or name == "__metadata__" then
      raise(fmt("safetensors.save: %s: bad tensor name %s (names are non-empty strings, not __metadata__)",
                path, tostring(name)))
    end
    names[#names + 1] = name
  end
  sort(names)

  local hdr, sizes = {}, {}
  local pos = 0
  for i, name in ipairs(names) do
    local id, shape, nbytes = describe(tensors[name], name, path)
    hdr[name] = { dtype = id_to_st[id], shape = shape, data_offsets = json.array({ pos, pos + nbytes }) }
    sizes[i] = nbytes
    pos = pos + nbytes
  end
  if metadata ~= nil then
    if type(metadata) ~= "table" then
      raise(fmt("safetensors.save: %s: metadata must be a table of strings, got %s", path, type(metadata)))
    end
    local m = json.object({})
    for k, v in pairs(metadata) do
      local tv = type(v)
      if type(k) ~= "string" or (tv ~= "string" and tv ~= "number" and tv ~= "boolean") then
        raise(fmt("safetensors.save: %s: metadata[%s] must map a string to a string, got %s",
                  path, tostring(k), tv))
      end
      m[k] = tv == "number" and json.encode(v) or tostring(v)
    end
    hdr.__metadata__ = m
  end

  local head = M.encode_header(hdr)

  local tmp = path .. ".tmp"
  local okf, f = pcall(fio.open, tmp, "w")
  if not okf then raise(fmt("safetensors.save: %s: cannot open for writing: %s", path, tostring(f))) end
  local ok, werr = pcall(function()
    f:append(head, #head)
    for i, name in ipairs(names) do write_tensor(f, tensors[name], sizes[i]) end
    f:sync()
    f:close()
  end)
  if not ok then
    pcall(f.close, f)
    os.remove(tmp)
    raise(fmt("safetensors.save: %s: write failed: %s", path, tostring(werr)))
  end
  local rok, rerr = pcall(fio.rename, tmp, path)
  if not rok then
    os.remove(tmp)
    raise(fmt("safetensors.save: %s: cannot rename into place: %s", path, tostring(rerr)))
  end
  return path
end

return M
