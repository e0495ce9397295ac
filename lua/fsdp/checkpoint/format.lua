-- fsdp.checkpoint.format: the checkpoint directory's schema and its
-- checksums (see fsdp/checkpoint/init.lua for the layout): the constants,
-- the hashing of shard files as they are written, reading and checking an
-- index.json, and a readable description of one.
local ffi = require "ffi"
local json = require "fsdp.json"
local fio = require "fsdp.io"
local common = require "fsdp.checkpoint.common"

local fmt, concat, sort = string.format, table.concat, table.sort
local floor, min, max = math.floor, math.min, math.max
local numel_of, shape_str, is_uint = common.numel_of, common.shape_str, common.is_uint

local M = {}

M.FORMAT = "fsdp-lua-checkpoint"
M.VERSION = 3
M.CHECKSUM = "xxh64"
M.ALIGN = 64                     -- every blob of a shard file starts at a multiple of this

local is_dir = fio.is_dir

-- ---- checksums ----

-- Fed with the bytes of a shard file as they are written: the XXH64 of
-- each blob (its padded extent), one pass over the bytes. The file's own
-- checksum is derived from those (file_checksum), not from a second pass.
local Hasher = {}
Hasher.__index = Hasher

function M.new_hasher()
  return setmetatable({ blob = fio.hasher(), blobs = {} }, Hasher)
end

function Hasher:begin_blob() self.blob:reset() end
function Hasher:update(ptr, n) self.blob:update(ptr, n) end

function Hasher:blob_hex()
  local h = self.blob:hex()
  self.blobs[#self.blobs + 1] = h
  return h
end

--- The checksum of a whole shard file: XXH64 of its blobs' checksums (16
-- hex digits each, in file order) followed by its size in decimal.
function M.file_checksum(blob_hexes, bytes)
  return fio.hash_string(concat(blob_hexes) .. fmt("%d", bytes))
end

function Hasher:file_hex(bytes) return M.file_checksum(self.blobs, bytes) end

--- The bytes of a blob of n payload bytes: padded to a multiple of ALIGN.
function M.padded(n) return M.ALIGN * math.ceil(n / M.ALIGN) end

--- The index file of a checkpoint directory.
function M.index_path(dir) return dir .. "/index.json" end

-- The index covers itself: its text ends with a last member
-- "index_checksum", the XXH64 of every byte before that member. A reader
-- checks it before trusting anything else in the index.
local SEAL = ',\n "index_checksum": "%s"\n}\n'

-- Fields read_index adds for its own use, never stored.
local RUNTIME = { label = true, blobs = true, param_map = true, file_map = true, dir = true,
  index_checksum = true, entry_checksum = true }

-- A copy of v without runtime fields (arrays stay arrays).
local function stored(v)
  if type(v) ~= "table" then return v end
  local c = {}
  for k, x in pairs(v) do
    if not RUNTIME[k] then c[k] = stored(x) end
  end
  return setmetatable(c, getmetatable(v))
end

-- Each parameter's entry (and each optimizer state entry) carries the
-- XXH64 of its own compact encoding, so that an index whose checksum fails
-- can still say which entries were edited.
local function entry_hash(e) return fio.hash_string(json.encode(stored(e))) end

--- format.encode_index(index) -> the text of index.json (sealed).
function M.encode_index(index)
  local t = stored(index)
  for _, p in ipairs(t.params or {}) do p.entry_checksum = entry_hash(p) end
  for _, e in ipairs(t.optimizer and t.optimizer.params or {}) do e.entry_checksum = entry_hash(e) end
  local text = json.encode(json.object(t), { indent = " " })
  local body = text:match("^(.*)\n}$")
  assert(body and body ~= "{", "format.encode_index: unexpected encoder output")
  return body .. fmt(SEAL, fio.hash_string(body))
end

-- Which entries of a decoded index no longer match their own checksums.
local function edited_entries(index)
  local l = {}
  local function check(list, what)
    if type(list) ~= "table" then return end
    for _, e in ipairs(list) do
      if type(e) == "table" then
        local ok, h = pcall(entry_hash, e)
        if not ok or h ~= e.entry_checksum then l[#l + 1] = fmt(what, tostring(e.path)) end
      end
    end
  end
  check(index.params, "parameter '%s'")
  check(type(index.optimizer) == "table" and index.optimizer.params, "optimizer state of '%s'")
  if #l > 3 then l = { l[1], l[2], l[3], fmt("%d more", #l - 3) } end
  return l
end

-- Checks that ranges (sorted by start) tile [0, n) exactly.
local function check_tiling(ranges, n, what)
  local at = 0
  for _, r in ipairs(ranges) do
    if r.start ~= at then
      error(fmt("%s: elements [%d, %d) are %s", what, min(at, r.start), max(at, r.start),
        r.start > at and "in no file" or "in two files"), 0)
    end
    at = r.start + r.count
  end
  if at ~= n then error(fmt("%s: elements [%d, %d) are %s", what, min(at, n), max(at, n),
    at < n and "in no file" or "beyond its size"), 0) end
end
M.check_tiling = check_tiling

local function bad(path, msg) error(fmt("%s: %s", path, msg), 0) end

local function is_hex16(s) return type(s) == "string" and #s == 16 and s:match("^%x+$") ~= nil end

--- fsdp.checkpoint.read_index(dir) -> index, checked in full before any
-- tensor data is read: the index's own checksum; format and version; the
-- files; for every parameter and optimizer state tensor, that its ranges
-- tile it exactly (no gap, no overlap) and that each range's blob lies
-- inside its file; that the blobs of each file tile the file exactly.
function M.read_index(dir)
  if type(dir) ~= "string" then error("fsdp.checkpoint.read_index: dir must be a string", 0) end
  dir = dir:gsub("/+$", "")
  local path = M.index_path(dir)
  if not is_dir(dir) then bad(dir, "no such checkpoint directory") end
  local okr, text = pcall(fio.read_file, path)
  if not okr then bad(path, "cannot open: " .. tostring(text) .. " (an incomplete checkpoint?)") end
  local ok, index = pcall(json.decode, text)
  if not ok then bad(path, "not valid JSON: " .. tostring(index)) end
  if not json.is_object(index) or index.format ~= M.FORMAT then
    bad(path, "not an fsdp-lua checkpoint index (format is " .. tostring(type(index) == "table" and index.format) .. ")")
  end
  if index.version ~= M.VERSION then
    bad(path, fmt("format version %s, this build reads version %d", tostring(index.version), M.VERSION))
  end
  local body, sum = text:match('^(.*),\n "index_checksum": "(%x+)"\n}\n$')
  if not body then bad(path, "the index has no index_checksum as its last member (edited or damaged)") end
  if fio.hash_string(body) ~= sum then
    local l = edited_entries(index)
    bad(path, "the index's checksum does not match its contents: the index was edited or damaged"
      .. (#l > 0 and (", in the entry of " .. concat(l, ", ")) or " (outside the parameter entries)"))
  end
  local ck = index.checksum
  if type(ck) ~= "table" or ck.algorithm ~= M.CHECKSUM then bad(path, "unknown checksum scheme") end

  local files = {}
  if type(index.files) ~= "table" or not json.is_array(index.files) then bad(path, "files missing") end
  for _, fe in ipairs(index.files) do
    if type(fe) ~= "table" or type(fe.name) ~= "string" or not fe.name:match("^rank_%d+%.bin$")
        or not is_uint(fe.bytes) or not is_hex16(fe.checksum) then
      bad(path, "bad entry in files")
    end
    if files[fe.name] then bad(path, "file " .. fe.name .. " is listed twice") end
    fe.blobs = {}
    files[fe.name] = fe
  end
  index.file_map = files

  -- ranges of one tensor: well-formed, inside their files, tiling [0, numel)
  local function check_ranges(ranges, numel, what)
    if type(ranges) ~= "table" or not json.is_array(ranges) then bad(path, what .. ": ranges missing") end
    for _, r in ipairs(ranges) do
      local fe = type(r) == "table" and files[r.file]
      if not fe then bad(path, what .. ": a range names an unknown file " .. tostring(type(r) == "table" and r.file)) end
      if not (is_uint(r.start) and is_uint(r.count) and is_uint(r.offset)) or r.count == 0
          or r.offset % M.ALIGN ~= 0 or r.offset + M.padded(4 * r.count) > fe.bytes then
        bad(path, fmt("%s: range [%s, +%s) at byte %s of %s does not fit in the file (%d bytes, blobs at multiples of %d)",
          what, tostring(r.start), tostring(r.count), tostring(r.offset), r.file, fe.bytes, M.ALIGN))
      end
      if not is_hex16(r.checksum) then bad(path, fmt("%s: range in %s has no checksum", what, r.file)) end
      r.label = fmt("%s elements [%d, %d)", what, r.start, r.start + r.count)
      local b = fe.blobs
      b[#b + 1] = r
    end
    local sorted = {}
    for i, r in ipairs(ranges) do sorted[i] = r end
    sort(sorted, function(a, b) return a.start < b.start end)
    local okt, err = pcall(check_tiling, sorted, numel, what)
    if not okt then bad(path, err) end
  end
  index.param_map = {}
  if type(index.params) ~= "table" or not json.is_array(index.params) then bad(path, "params missing") end
  for _, p in ipairs(index.params) do
    if type(p) ~= "table" or type(p.path) ~= "string" or type(p.shape) ~= "table" or p.dtype ~= "F32" then
      bad(path, "bad entry in params")
    end
    for _, s in ipairs(p.shape) do
      if not is_uint(s) then bad(path, "parameter '" .. p.path .. "': bad shape") end
    end
    if numel_of(p.shape) ~= p.numel then bad(path, "parameter '" .. p.path .. "': numel does not match its shape") end
    if index.param_map[p.path] then bad(path, "parameter '" .. p.path .. "' is listed twice") end
    check_ranges(p.ranges, p.numel, "parameter '" .. p.path .. "'")
    index.param_map[p.path] = p
  end
  local o = index.optimizer
  if o ~= nil then
    if type(o) ~= "table" or type(o.type) ~= "string" or type(o.states) ~= "table" or type(o.params) ~= "table" then
      bad(path, "bad optimizer entry")
    end
    o.param_map = {}
    for _, e in ipairs(o.params) do
      local p = type(e) == "table" and index.param_map[e.path]
      if not p then bad(path, "optimizer state for unknown parameter " .. tostring(type(e) == "table" and e.path)) end
      if o.param_map[e.path] then bad(path, "optimizer state of '" .. e.path .. "' is listed twice") end
      for _, nm in ipairs(o.states) do
        if e[nm] ~= nil then check_ranges(e[nm], p.numel, "optimizer state " .. nm .. " of '" .. e.path .. "'") end
      end
      o.param_map[e.path] = e
    end
  end
  -- every byte of a file belongs to exactly one blob
  for name, fe in pairs(files) do
    local b = fe.blobs
    sort(b, function(x, y) return x.offset < y.offset end)
    local at = 0
    for _, r in ipairs(b) do
      if r.offset ~= at then
        bad(path, fmt("%s: bytes [%d, %d) %s (at %s)", name, min(at, r.offset), max(at, r.offset),
          r.offset > at and "belong to no tensor" or "belong to two tensors", r.label))
      end
      at = r.offset + M.padded(4 * r.count)
    end
    if at ~= fe.bytes then bad(path, fmt("%s: bytes [%d, %d) belong to no tensor", name, at, fe.bytes)) end
  end
  index.dir = dir
  return index
end

local function human(n)
  if n >= 2 ^ 30 then return fmt("%.2f GiB", n / 2 ^ 30) end
  if n >= 2 ^ 20 then return fmt("%.1f MiB", n / 2 ^ 20) end
  if n >= 2 ^ 10 then return fmt("%.1f KiB", n / 2 ^ 10) end
  return fmt("%d B", n)
end

--- fsdp.checkpoint.describe(dir) -> text: a checkpoint's index (parameters,
-- shapes, step, world size, files and sizes) without reading its tensors.
function M.describe(dir)
  local index = M.read_index(dir)
  local lines = {}
  local function add(...) lines[#lines + 1] = fmt(...) end
  local function show(v)
    if v == nil or v == json.null then return "-" end
    return type(v) == "table" and json.encode(v) or tostring(v)
  end
  add("checkpoint %s (format %s version %d)", index.dir, index.format, index.version)
  add("  step %s, saved by %d rank(s), %d file(s), strategy %s%s", show(index.step), index.world_size,
    #index.files, tostring(index.strategy), index.group_size and (", group size " .. index.group_size) or "")
  local m = index.model or {}
  add("  model %s: %d parameters, %d elements (%s in f32)", tostring(m.type), #index.params, m.numel or 0,
    human(4 * (m.numel or 0)))
  if index.schedule ~= nil then add("  schedule %s", show(index.schedule)) end
  if index.data ~= nil then add("  data %s", show(index.data)) end
  if index.rng ~= nil then add("  rng %s", show(index.rng)) end
  if index.extra ~= nil then add("  extra %s", show(index.extra)) end
  if type(index.run) == "table" then add("  run %s (went on from %s)", show(index.run.id), show(index.run.forked)) end
  local o = index.optimizer
  if o then
    add("  optimizer %s: step count %s, states %s, %d parameters with state", o.type, show(o.step_count),
      concat(o.states, ", "), #o.params)
    for gi, g in ipairs(o.groups or {}) do
      local kv = {}
      for k, v in pairs(g) do kv[#kv + 1] = k .. "=" .. (type(v) == "number" and fmt("%.6g", v) or tostring(v)) end
      sort(kv)
      add("    group %d: %s", gi, concat(kv, " "))
    end
  else
    add("  optimizer: none saved")
  end
  add("  files (checksums %s):", index.checksum.algorithm)
  local total = 0
  for _, fe in ipairs(index.files) do
    local kind, bytes = fio.stat(index.dir .. "/" .. fe.name)
    local on_disk = kind == "file" and bytes
    local state = not on_disk and "MISSING" or (on_disk ~= fe.bytes and fmt("SIZE %d ON DISK", on_disk) or "ok")
    add("    %-16s %12d bytes (%s) checksum %s %s", fe.name, fe.bytes, human(fe.bytes), fe.checksum, state)
    total = total + fe.bytes
  end
  add("    total %s", human(total))
  add("  parameters:")
  for _, p in ipairs(index.params) do
    local files = {}
    for _, r in ipairs(p.ranges) do files[#files + 1] = r.file:match("(%d+)") + 0 end
    add("    %-40s %-18s %10d  in %s", p.path, shape_str(p.shape), p.numel,
      #files == 1 and ("file " .. files[1]) or fmt("files %d-%d", files[1], files[#files]))
  end
  return concat(lines, "\n")
end

return M
