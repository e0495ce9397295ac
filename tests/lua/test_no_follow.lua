-- No write follows a planted link, and no read of a FIFO, device or folder
-- hangs. For each writer, a symbolic link to a sentinel file outside the
-- target's folder is planted at the target name and at its temporary name;
-- after the write the sentinel must be byte-identical and the target a
-- regular file holding what was written. For each reader, a FIFO, a
-- character device and a folder stand where a file is expected: each is
-- refused at once, with its name.

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local ffi = require "ffi"
local fsdp = require "fsdp"
local fio = require "fsdp.io"
local core = require "fsdp.core"
local data = require "fsdp.data"
local safetensors = require "fsdp.safetensors"
local options = require "fsdp.options"

local root = os.tmpname()
os.remove(root)
fio.mkdirs(root .. "/out")
fio.mkdirs(root .. "/outside")
local sentinel = root .. "/outside/sentinel"
local SENTINEL = "sentinel bytes that no writer may touch\n"
fio.write_atomic(sentinel, SENTINEL)

local function sh(cmd) return os.execute(cmd) end
local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end
local function is_link(p) return sh("test -L " .. q(p)) == 0 or sh("test -L " .. q(p)) == true end

local followed = 0
-- writer(path) writes into path; check(path) -> true when path holds it.
local function planted(name, temps, writer, check)
  local target = root .. "/out/" .. name
  for _, p in ipairs({ target, unpack(temps(target)) }) do
    os.remove(p)
    sh("ln -s " .. q(sentinel) .. " " .. q(p))
  end
  local ok, err = pcall(writer, target)
  local same = fio.read_file(sentinel) == SENTINEL
  if not same then
    followed = followed + 1
    print("FOLLOWED: " .. name)
    fio.write_atomic(sentinel, SENTINEL)
  end
  t.ok(ok, name .. ": the write succeeds (" .. tostring(err) .. ")")
  t.ok(same, name .. ": the sentinel behind the planted links is untouched")
  t.ok(not is_link(target) and fio.stat(target) == "file", name .. ": the target is a regular file now")
  local cok, held = pcall(check, target)
  t.ok(ok and cok and held, name .. ": the target holds what was written")
  for _, p in ipairs(temps(target)) do
    t.ok(not is_link(p) or fio.read_file(sentinel) == SENTINEL, name .. ": " .. p .. " left harmless")
  end
end

local function tmp(target) return { target .. ".tmp" } end
local function none() return {} end

planted("write_atomic.json", tmp, function(p) fio.write_atomic(p, "{\"a\":1}\n") end,
  function(p) return fio.read_file(p) == "{\"a\":1}\n" end)

planted("open_w.bin", none, function(p)
  local f = fio.open(p, "w"); f:append("abc", 3); f:close()
end, function(p) return fio.read_file(p) == "abc" end)

planted("shard.bin", tmp, function(p) data.write_shard(p, { 5, 7, 65535, 0, 3 }) end, function(p)
  local s = fio.read_file(p)
  return #s == data.HEADER_BYTES + 10 and s:sub(-10) == "\5\0\7\0\255\255\0\0\3\0"
end)

planted("model.safetensors", tmp, function(p)
  safetensors.save(p, { w = fsdp.tensor({ 1, 2, 3 }) })
end, function(p)
  local back = safetensors.load(p)
  return back.w and back.w:tolist()[3] == 3
end)

planted("trace.json", tmp, function(p)
  if core.C.fsdp_trace_start(p) ~= 0 then error(ffi.string(core.C.fsdp_last_error())) end
  core.C.fsdp_trace_step(1)
  if core.C.fsdp_trace_stop() ~= 0 then error(ffi.string(core.C.fsdp_last_error())) end
end, function(p) return fio.read_file(p):match("^{\"displayTimeUnit\"") ~= nil end)

planted("metrics.jsonl", none, function(p)
  local m = require("fsdp.metrics").new { path = p }
  m:begin_step()
  m:end_step { step = 1, loss = 2.5, lr = 1e-3 }
  m:close()
end, function(p) return fio.read_file(p):match("\"loss\":2.5") ~= nil end)

planted("calibration.json", tmp, function(p) require("fsdp.calibrate").write(p, { x = 1 }) end,
  function(p) return fio.read_file(p):match("\"x\":1") ~= nil end)

-- the option check for an output file must not write through a link either
planted("outfile_check", tmp, function(p)
  local why = options.outfile_problem(p)
  if why then error(why) end
  fio.write_atomic(p, "ok")
end, function(p) return fio.read_file(p) == "ok" end)

print(string.format("writers that followed a planted link: %d", followed))
t.eq(followed, 0, "no writer followed a planted link")

-- ---- inputs that would hang or mislead ----
local fifo = root .. "/in.fifo"
sh("mkfifo " .. q(fifo))
local folder = root .. "/in.dir"
fio.mkdirs(folder)

-- Should a check open the FIFO without O_NONBLOCK, a writer shows up (and
-- closes) within a few seconds, so the test fails instead of hanging.
local function rescue()
  sh("(timeout 5 sh -c 'while [ -p " .. fifo .. " ]; do exec 3>" .. fifo .. "; exec 3>&-; done' &) >/dev/null 2>&1")
end

local now = require("fsdp.timer").now
local function refused(name, fn, path, needle)
  rescue()
  local t0 = now()
  local ok, err = pcall(fn, path)
  local secs = now() - t0
  err = tostring(err)
  t.ok(not ok or (type(err) == "string" and err ~= "nil"), name .. ": refused")
  t.ok(secs < 2, string.format("%s: refused at once (%.2f s)", name, secs))
  t.ok(err:find(path, 1, true) ~= nil or err:find(needle, 1, true) ~= nil, name .. ": names the file: " .. err)
  t.ok(err:find(needle, 1, true) ~= nil, name .. ": says what it is (" .. needle .. "): " .. err)
end

local function raise_problem(f) return function(p) local why = f(p); if why then error(p .. ": " .. why, 0) end end end

for _, c in ipairs({ { fifo, "FIFO" }, { "/dev/zero", "character device" }, { folder, "directory" } }) do
  local path, what = c[1], c[2]
  refused("fsdp.io.open " .. what, fio.open, path, what)
  refused("read_file " .. what, fio.read_file, path, what)
  refused("option file check " .. what, raise_problem(options.file_problem), path, what == "directory" and "Is a directory" or what)
  refused("safetensors.load " .. what, safetensors.load, path, what == "directory" and "Is a directory" or what)
  refused("tokenizer " .. what, function(p) require("fsdp.tokenizer").gpt2 { encoder = p, vocab = p } end, path,
    what == "directory" and "Is a directory" or what)
  if what ~= "directory" then
    refused("data.open " .. what, function(p) data.open(p, nil, { flag = "--data", block = 4, batch = 1 }) end, path, what)
    refused("outfile check " .. what, raise_problem(options.outfile_problem), path, "not a regular file")
  end
end
refused("read_shard FIFO", data.read_shard, fifo, "FIFO")

os.remove(fifo)
pcall(fio.remove_tree, root)   -- a rescue loop may still be running
t.done()
