-- Tests for fsdp.io (engine/io): XXH64 against published digests and, when
-- the system has it, the reference libxxhash on random inputs of every
-- length 0..300 and odd splits of the streaming form; files (positioned
-- reads and writes, short reads at the end, append, atomic writes);
-- directories (mkdir -p, sorted listing, removal of a tree with a link
-- that must not be followed); errors that name the path and the reason.

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local ffi = require "ffi"
local fio = require "fsdp.io"

local tmp = os.tmpname()
os.remove(tmp)
fio.mkdirs(tmp)
local function P(name) return tmp .. "/" .. name end

-- ======================= XXH64 =======================

-- Published digests (xxhsum -H64 of these inputs, seed 0).
t.eq(fio.hash_string(""), "ef46db3751d8e999", "XXH64 of the empty input")
t.eq(fio.hash_string("a"), "d24ec4f1a98c6e5b", "XXH64 of 'a'")
t.eq(fio.hash_string("abc"), "44bc2cf5ad770999", "XXH64 of 'abc'")
t.eq(fio.hash_string("Nobody inspects the spammish repetition"), "fbcea83c8a378bf1",
  "XXH64 of a sentence longer than one stripe")

-- random bytes from a fixed LCG
local function bytes(n, seed)
  local b = ffi.new("uint8_t[?]", n > 0 and n or 1)
  local s = seed
  for i = 0, n - 1 do
    s = (s * 1103515245 + 12345) % 2147483648
    b[i] = math.floor(s / 65536) % 256
  end
  return b
end

local ref_ok, ref = pcall(ffi.load, "libxxhash.so.0")
if ref_ok then
  ffi.cdef [[ unsigned long long XXH64(const void *input, size_t length, unsigned long long seed); ]]
  local bad = 0
  for n = 0, 300 do
    local b = bytes(n, n + 1)
    if fio.hash64(b, n) ~= bit.tohex(ref.XXH64(b, n, 0), 16) then bad = bad + 1 end
  end
  t.eq(bad, 0, "XXH64 equals libxxhash for every length 0..300")
  local b = bytes(1048576, 5)
  t.eq(fio.hash64(b, 1048576), bit.tohex(ref.XXH64(b, 1048576, 0), 16), "XXH64 equals libxxhash on 1 MiB")
else
  print("test_io: libxxhash not found; the published digests stand alone")
end

-- streaming in uneven pieces equals one shot
do
  local n = 1000
  local b = bytes(n, 9)
  local want = fio.hash64(b, n)
  local bad = 0
  for step = 1, 70, 3 do
    local h = fio.hasher()
    local at = 0
    while at < n do
      local k = math.min(step + at % 5, n - at)
      h:update(b + at, k)
      at = at + k
    end
    if h:hex() ~= want then bad = bad + 1 end
  end
  t.eq(bad, 0, "streaming XXH64 in pieces of 1..74 bytes equals one shot")
  local h = fio.hasher()
  h:update(b, 10)
  local part = h:hex()
  t.eq(part, fio.hash64(b, 10), "digest midway is the hash so far")
  h:update(b + 10, n - 10)
  t.eq(h:hex(), want, "and feeding goes on after a digest")
  h:reset()
  t.eq(h:hex(), fio.hash_string(""), "reset starts over")
  -- one flipped bit anywhere changes the digest
  local changed = 0
  for i = 0, n - 1, 37 do
    b[i] = bit.bxor(b[i], 128)
    if fio.hash64(b, n) ~= want then changed = changed + 1 end
    b[i] = bit.bxor(b[i], 128)
  end
  t.eq(changed, math.floor((n - 1) / 37) + 1, "every flipped top bit changes the digest")
end

-- ======================= files =======================

do
  local f = fio.open(P("a.bin"), "w")
  f:append("hello ", 6)
  f:append("world", 5)
  f:pwrite("W", 1, 6)
  f:sync()
  f:close()
  f:close()   -- twice is fine
  t.eq(fio.read_file(P("a.bin")), "hello World", "append, pwrite over, read back")
  local kind, size = fio.stat(P("a.bin"))
  t.ok(kind == "file" and size == 11, "stat of a file: kind and size")
  local r = fio.open(P("a.bin"))
  t.eq(r:size(), 11, "size of an open file")
  local buf = ffi.new("uint8_t[16]")
  t.eq(r:pread(buf, 16, 6), 5, "pread past the end is short")
  t.eq(ffi.string(buf, 5), "World", "pread at an offset")
  t.eq(r:pread(buf, 4, 100), 0, "pread beyond the end reads nothing")
  t.raises(function() r:pwrite("x", 1, 0) end, { "a.bin", "open for reading" }, "no writes through a read handle")
  t.raises(function() r:pread(buf, -1, 0) end, { "fsdp_file_pread", "bad range" }, "negative length")
  r:close()
  t.raises(function() r:size() end, { "a.bin", "closed" }, "a closed file")

  fio.write_atomic(P("b.txt"), "one")
  fio.write_atomic(P("b.txt"), "two!")
  t.eq(fio.read_file(P("b.txt")), "two!", "write_atomic replaces")
  t.eq(fio.stat(P("b.txt.tmp")), "none", "write_atomic leaves no temporary")

  t.raises(function() fio.open(P("nope.bin")) end, { "cannot open", "nope.bin", "No such file" }, "missing file")
  t.raises(function() fio.open(tmp) end, { "cannot open", "Is a directory" }, "a directory is not a file")
  t.raises(function() fio.open(P("no/dir/x.bin"), "w") end, { "cannot create", "no/dir/x.bin" },
    "create in a missing directory")
  t.raises(function() fio.open(P("a.bin"), "rw") end, { "mode must be" }, "unknown mode")
  t.raises(function() fio.write_atomic(P("no/dir/x"), "x") end, { "no/dir/x.tmp" }, "write_atomic into nowhere")
end

-- ======================= directories =======================

do
  fio.mkdirs(P("d/e/f"))
  fio.mkdirs(P("d/e/f"))   -- again: fine
  fio.mkdirs(P("d//g/"))
  t.eq(fio.stat(P("d/e/f")), "dir", "mkdirs makes every level")
  t.ok(fio.is_dir(P("d/g")) and not fio.is_dir(P("a.bin")) and not fio.is_dir(P("nothing")), "is_dir")
  for _, n in ipairs({ "z", "b", "a", ".hidden", "B" }) do fio.write_atomic(P("d/" .. n), n) end
  local names = fio.list_dir(P("d"))
  t.eq(table.concat(names, ","), ".hidden,B,a,b,e,g,z", "list_dir: every name, sorted bytewise")
  t.raises(function() fio.list_dir(P("nothing")) end, { "cannot list directory", "nothing" }, "list a missing dir")
  t.raises(function() fio.mkdirs(P("a.bin/x")) end, { "cannot create directory", "a.bin" }, "mkdirs through a file")

  -- a link to a directory outside the tree: removed, its target kept
  fio.mkdirs(P("keep"))
  fio.write_atomic(P("keep/precious"), "x")
  assert(os.execute("ln -s '" .. P("keep") .. "' '" .. P("d/e/link") .. "'"))
  fio.remove_tree(P("d"))
  t.eq(fio.stat(P("d")), "none", "remove_tree removes the tree")
  t.eq(fio.read_file(P("keep/precious")), "x", "remove_tree does not follow links")
  fio.remove_tree(P("d"))   -- absent: fine
  fio.remove_tree(P("b.txt"))
  t.eq(fio.stat(P("b.txt")), "none", "remove_tree of a file")
  t.raises(function() fio.remove_tree("/") end, { "refusing" }, "remove_tree refuses /")
  t.raises(function() fio.remove_tree("") end, { "empty" }, "remove_tree refuses an empty path")

  fio.mkdirs(P("r1"))
  fio.write_atomic(P("r1/x"), "x")
  fio.rename(P("r1"), P("r2"))
  t.ok(fio.stat(P("r1")) == "none" and fio.read_file(P("r2/x")) == "x", "rename a directory")
  t.raises(function() fio.rename(P("r1"), P("r3")) end, { "cannot rename", "r1", "No such file" }, "rename nothing")
  t.eq(fio.parent("a/b/c"), "a/b", "parent")
  t.eq(fio.parent("c"), ".", "parent of a bare name")
  t.eq(fio.parent("/c/"), "/", "parent at the root")
end

fio.remove_tree(tmp)
t.done()
