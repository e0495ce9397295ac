-- fsdp.io: files, directories and checksums, through the engine
-- (engine/io): no shell commands, no libc declared here. Every failure is a
-- Lua error carrying the engine's message (the call, the path, the reason).
--
--   local fio = require "fsdp.io"
--   local f = fio.open("w.bin", "w")       -- "r": read an existing file
--   f:append(ptr, n); f:pwrite(ptr, n, off); f:sync(); f:close()
--   local got = fio.open("w.bin"):pread(ptr, n, off)
--   fio.write_atomic("index.json", text)   -- all of it or nothing, durable
--   local w = fio.replace("out.bin"); w:write(s); w:publish()   -- or w:abort()
--   fio.file_problem(path) -> nil, or why path is no regular file (never blocks)
-- Files opened "w" are created afresh: a link planted at the name is
-- unlinked, never followed (O_CREAT|O_EXCL|O_NOFOLLOW).
--   fio.stat(path) -> "none" | "file" | "dir" | "other", bytes
--   fio.mkdirs(path); fio.remove_tree(path); fio.rename(a, b); fio.list_dir(path)
--   fio.hash64(ptr, n) / fio.hash_string(s) -> 16 hex digits (XXH64, as xxhsum prints it)
--   local h = fio.hasher(); h:update(ptr, n); h:hex()

local ffi = require "ffi"
local bit = require "bit"
local core = require "fsdp.core"

local C = core.C
local fmt = string.format

local M = {}

local function fail() error(ffi.string(C.fsdp_last_error()), 0) end

-- ---- files ----

local File = {}
File.__index = File

local file_box = ffi.new("fsdp_file *[1]")
local i64_box = ffi.new("int64_t[1]")
local modes = { r = C.FSDP_FILE_READ, w = C.FSDP_FILE_CREATE }

--- fio.open(path, mode) -> File. mode "r" (default): an existing file;
-- "w": created or truncated.
function M.open(path, mode)
  local m = modes[mode or "r"]
  if not m then error(fmt("fsdp.io.open: mode must be 'r' or 'w', got %s", tostring(mode)), 0) end
  if type(path) ~= "string" then error("fsdp.io.open: path must be a string, got " .. type(path), 0) end
  if C.fsdp_file_open(file_box, path, m) ~= 0 then fail() end
  local h = ffi.gc(file_box[0], C.fsdp_file_close)
  file_box[0] = nil
  return setmetatable({ h = h, path = path }, File)
end

function File:_handle()
  if self.h == nil then error("fsdp.io: " .. self.path .. ": file is closed", 0) end
  return self.h
end

--- f:close(): a failed close of a written file is an error. Twice is fine.
function File:close()
  local h = self.h
  if h == nil then return end
  self.h = nil
  ffi.gc(h, nil)
  if C.fsdp_file_close(h) ~= 0 then fail() end
end

function File:size()
  if C.fsdp_file_size(self:_handle(), i64_box) ~= 0 then fail() end
  return tonumber(i64_box[0])
end

--- f:pread(ptr, n, off) -> bytes read (fewer than n only at the end of the file).
function File:pread(ptr, n, off)
  if C.fsdp_file_pread(self:_handle(), ptr, n, off, i64_box) ~= 0 then fail() end
  return tonumber(i64_box[0])
end

--- f:pwrite(ptr, n, off): all n bytes at off (ptr may be a string).
function File:pwrite(ptr, n, off)
  if C.fsdp_file_pwrite(self:_handle(), ptr, n, off) ~= 0 then fail() end
end

--- f:append(ptr, n): all n bytes after the furthest byte written so far.
function File:append(ptr, n)
  if C.fsdp_file_append(self:_handle(), ptr, n) ~= 0 then fail() end
end

--- f:sync(): fsync.
function File:sync()
  if C.fsdp_file_sync(self:_handle()) ~= 0 then fail() end
end

--- fio.write_atomic(path, text): path holds exactly text, or is as it was.
function M.write_atomic(path, text)
  if C.fsdp_file_write_atomic(path, text, #text) ~= 0 then fail() end
end

--- fio.read_file(path) -> the whole file as a string.
function M.read_file(path)
  local f = M.open(path, "r")
  local ok, res = pcall(function()
    local n = f:size()
    local buf = ffi.new("uint8_t[?]", n > 0 and n or 1)
    local got = f:pread(buf, n, 0)
    return ffi.string(buf, got)
  end)
  f:close()
  if not ok then error(res, 0) end
  return res
end

--- fio.file_problem(path) -> nil when path opens as a regular file for
-- reading, else the engine's one-line reason (a FIFO, a device or a folder
-- is refused at once: the open cannot block).
function M.file_problem(path)
  if type(path) ~= "string" then return "path must be a string, got " .. type(path) end
  if C.fsdp_file_open(file_box, path, C.FSDP_FILE_READ) ~= 0 then return ffi.string(C.fsdp_last_error()) end
  C.fsdp_file_close(file_box[0])
  file_box[0] = nil
  return nil
end

--- fio.expect_file(path): raises file_problem's reason, if any.
function M.expect_file(path)
  local why = M.file_problem(path)
  if why then error(why, 0) end
end

-- A file written under a temporary name beside its target and renamed over
-- it when done: the temporary is created afresh (O_EXCL|O_NOFOLLOW, whatever
-- was planted at its name unlinked first) and the rename replaces a link at
-- the target itself, so no write goes through a symbolic link.
local Replacement = {}
Replacement.__index = Replacement

--- fio.replace(path) -> w; w:write(s, ...) appends strings; w:publish()
-- makes them path's contents (durably); w:abort() leaves path as it was.
function M.replace(path)
  if type(path) ~= "string" then error("fsdp.io.replace: path must be a string, got " .. type(path), 0) end
  local tmp = path .. ".tmp"
  return setmetatable({ path = path, tmp = tmp, f = M.open(tmp, "w") }, Replacement)
end

function Replacement:write(...)
  if not self.f then error("fsdp.io: " .. self.path .. ": already published or aborted", 0) end
  for i = 1, select("#", ...) do
    local s = tostring((select(i, ...)))
    self.f:append(s, #s)
  end
  return self
end

function Replacement:publish()
  local f = self.f
  if not f then error("fsdp.io: " .. self.path .. ": already published or aborted", 0) end
  self.f = nil
  local ok, err = pcall(function()
    f:sync()
    f:close()
    M.rename(self.tmp, self.path)
  end)
  if not ok then
    pcall(f.close, f)
    os.remove(self.tmp)
    error(err, 0)
  end
end

function Replacement:abort()
  local f = self.f
  if not f then return end
  self.f = nil
  pcall(f.close, f)
  os.remove(self.tmp)
end

-- ---- paths ----

local kind_box = ffi.new("fsdp_path_kind[1]")
local kind_names = { [0] = "none", "file", "dir", "other" }

--- fio.stat(path) -> "none" | "file" | "dir" | "other", size in bytes.
function M.stat(path)
  if C.fsdp_path_stat(path, kind_box, i64_box) ~= 0 then fail() end
  return kind_names[tonumber(kind_box[0])], tonumber(i64_box[0])
end

function M.is_dir(path) return type(path) == "string" and path ~= "" and M.stat(path) == "dir" end
function M.is_file(path) return type(path) == "string" and path ~= "" and M.stat(path) == "file" end

function M.mkdirs(path)
  if C.fsdp_path_mkdirs(path) ~= 0 then fail() end
end

--- fio.remove_tree(path): rm -rf (links removed, not followed); absent is fine.
function M.remove_tree(path)
  if C.fsdp_path_remove_tree(path) ~= 0 then fail() end
end

--- fio.rename(from, to): atomic, then the directory of to synced.
function M.rename(from, to)
  if C.fsdp_path_rename(from, to) ~= 0 then fail() end
end

function M.sync_path(path)
  if C.fsdp_path_sync(path) ~= 0 then fail() end
end

local list_box = ffi.new("fsdp_dir_listing *[1]")
local name_box = ffi.new("const char *[1]")

--- fio.list_dir(path) -> sorted names (no "." or "..").
function M.list_dir(path)
  if C.fsdp_dir_list(list_box, path) ~= 0 then fail() end
  local l = ffi.gc(list_box[0], C.fsdp_dir_listing_free)
  list_box[0] = nil
  if C.fsdp_dir_listing_count(l, i64_box) ~= 0 then fail() end
  local names = {}
  for i = 0, tonumber(i64_box[0]) - 1 do
    if C.fsdp_dir_listing_name(l, i, name_box) ~= 0 then fail() end
    names[#names + 1] = ffi.string(name_box[0])
  end
  C.fsdp_dir_listing_free(ffi.gc(l, nil))
  return names
end

--- fio.parent(path) -> the folder holding path ("." when none is named).
function M.parent(path)
  local p = path:gsub("/+$", ""):match("^(.*)/[^/]*$")
  if p == nil then return "." end
  return p == "" and "/" or p
end

-- ---- checksums ----

local u64_box = ffi.new("uint64_t[1]")

local function hex(v) return bit.tohex(v, 16) end
M.hex = hex

--- fio.hash64(ptr, n) -> XXH64 of n bytes, as 16 hex digits.
function M.hash64(ptr, n)
  if C.fsdp_hash64(ptr, n, 0, u64_box) ~= 0 then fail() end
  return hex(u64_box[0])
end

function M.hash_string(s) return M.hash64(s, #s) end

local Hasher = {}
Hasher.__index = Hasher
local hasher_box = ffi.new("fsdp_hasher *[1]")

--- fio.hasher() -> a running XXH64: h:update(ptr, n), h:hex(), h:reset().
function M.hasher()
  if C.fsdp_hasher_new(hasher_box, 0) ~= 0 then fail() end
  local h = ffi.gc(hasher_box[0], C.fsdp_hasher_free)
  hasher_box[0] = nil
  return setmetatable({ h = h, bytes = 0 }, Hasher)
end

function Hasher:update(ptr, n)
  if C.fsdp_hasher_update(self.h, ptr, n) ~= 0 then fail() end
  self.bytes = self.bytes + n
end

function Hasher:hex()
  if C.fsdp_hasher_digest(self.h, u64_box) ~= 0 then fail() end
  return hex(u64_box[0])
end

function Hasher:reset()
  if C.fsdp_hasher_reset(self.h, 0) ~= 0 then fail() end
  self.bytes = 0
end

return M
