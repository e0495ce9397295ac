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
M.VERSION = 2
M.CHECKSUM = "xxh64"
M.chunk_bytes = 1048576          -- checksum granularity (a multiple of 64)
M.ALIGN = 64                     -- every blob of a shard file starts at a multiple of this

local u8p = ffi.typeof("const uint8_t *")
local is_dir = fio.is_dir

-- ---- checksums: XXH64 per chunk, per blob and per file ----

local chunk_hash = fio.hash64

-- Fed with the bytes of a file as they are written: the hash of every
-- chunk of chunk bytes, and of the whole file.
local Hasher = {}
Hasher.__index = Hasher

local function new_hasher(chunk)
  return setmetatable({ chunk = chunk, pos = 0, chunks = {}, part = fio.hasher(), whole = fio.hasher() }, Hasher)
end

function Hasher:update(ptr, n)
  local p = ffi.cast(u8p, ptr)
  self.whole:update(p, n)
  while n > 0 do
    local m = min(n, self.chunk - self.pos)
    self.part:update(p, m)
    self.pos, p, n = self.pos + m, p + m, n - m
    if self.pos == self.chunk then
      self.chunks[#self.chunks + 1] = self.part:hex()
      self.part:reset()
      self.pos = 0
    end
  end
end

function Hasher:finish()
  if self.pos > 0 then self.chunks[#self.chunks + 1] = self.part:hex() end
  return self.whole:hex(), self.chunks
end

M.new_hasher = new_hasher
M.chunk_hash = chunk_hash

--- The index file of a checkpoint directory.
function M.index_path(dir) return dir .. "/index.json" end

-- Checks that ranges tile [0, n) exactly.
local function check_tiling(ranges, n, what)
  local at = 0
  for _, r in ipairs(ranges) do
    if r.start ~= at then
      error(fmt("%s: elements [%d, %d) are %s", what, min(at, r.start), max(at, r.start),
        r.start > at and "in no file" or "in two files"), 0)
    end
    at = r.start + r.count
  end
  if at ~= n then error(fmt("%s: elements [%d, %d) are in no file", what, at, n), 0) end
end

M.check_tiling = check_tiling

local function bad(path, msg) error(fmt("%s: %s", path, msg), 0) end

--- fsdp.checkpoint.read_index(dir) -> index (checked: format, version,
-- files, ranges). Reads no tensor data.
function M.read_index(dir)
  if type(dir) ~= "string" then raise("fsdp.checkpoint.read_index: dir must be a string") end
  dir = dir:gsub("/+$", "")
  local path = dir .. "/index.json"
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
  local ck = index.checksum
  if type(ck) ~= "table" or ck.algorithm ~= M.CHECKSUM or not is_uint(ck.chunk_bytes) or ck.chunk_bytes == 0
      or ck.chunk_bytes % 32 ~= 0 then
    bad(path, "unknown checksum scheme")
  end
  local files = {}
  if type(index.files) ~= "table" then bad(path, "files missing") end
  for _, fe in ipairs(index.files) do
    if type(fe) ~= "table" or type(fe.name) ~= "string" or fe.name:find("/") or not is_uint(fe.bytes)
        or type(fe.chunks) ~= "table" or type(fe.checksum) ~= "string" then
      bad(path, "bad entry in files")
    end
    if #fe.chunks ~= math.ceil(fe.bytes / ck.chunk_bytes) then
      bad(path, fmt("the index lists %d chunk checksums for %s, its %d bytes make %d chunks (the index is damaged)",
        #fe.chunks, fe.name, fe.bytes, math.ceil(fe.bytes / ck.chunk_bytes)))
    end
    files[fe.name] = fe
  end
  index.file_map = files
  for _, fe in pairs(files) do fe.blobs = {} end
  local function check_ranges(ranges, numel, what)
    if type(ranges) ~= "table" then bad(path, what .. ": ranges missing") end
    for _, r in ipairs(ranges) do
      local fe = type(r) == "table" and files[r.file]
      if not fe then bad(path, what .. ": a range names an unknown file " .. tostring(type(r) == "table" and r.file)) end
      if not (is_uint(r.start) and is_uint(r.count) and is_uint(r.offset)) or r.start + r.count > numel
          or r.offset + 4 * r.count > fe.bytes then
        bad(path, fmt("%s: range [%s, +%s) at byte %s of %s does not fit", what, tostring(r.start),
          tostring(r.count), tostring(r.offset), r.file))
      end
      local b = fe.blobs
      b[#b + 1] = { offset = r.offset, bytes = 4 * r.count, checksum = r.checksum,
        label = fmt("%s elements [%d, %d)", what, r.start, r.start + r.count) }
    end
  end
  index.param_map = {}
  if type(index.params) ~= "table" then bad(path, "params missing") end
  for _, p in ipairs(index.params) do
    if type(p) ~= "table" or type(p.path) ~= "string" or type(p.shape) ~= "table" or p.dtype ~= "F32" then
      bad(path, "bad entry in params")
    end
    for _, s in ipairs(p.shape) do
      if not is_uint(s) then bad(path, "parameter '" .. p.path .. "': bad shape") end
    end
    if numel_of(p.shape) ~= p.numel then bad(path, "parameter '" .. p.path .. "': numel does not match its shape") end
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
      for _, nm in ipairs(o.states) do
        if e[nm] ~= nil then check_ranges(e[nm], p.numel, "optimizer state " .. nm .. " of '" .. e.path .. "'") end
      end
      o.param_map[e.path] = e
    end
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
  add("  files (checksums %s, %s chunks):", index.checksum.algorithm, human(index.checksum.chunk_bytes))
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
