-- Fuzzed checkpoint directories (bounded, seeded): a sharded GPT with AdamW
-- state saved by 2 ranks, then --cases damaged copies, each loaded by every
-- rank. A case is an edit of index.json in place (a digit, a bit, a byte
-- cut or added, a truncation), a forged index (one range, file or shape
-- field changed and the index re-sealed, as a forger or a buggy writer
-- would), or an edit of a shard file (a bit, a truncation, bytes appended,
-- the file removed or replaced by the other one). Each load must raise an
-- error and leave the model and optimizer exactly as they were, or succeed
-- with state bit-identical to the pristine load. Counts are printed; any
-- silent difference, touched model or crash fails the test.
--   mpirun -np 2 fsdp-lua tests/fuzz/test_fuzz_checkpoint.lua --dir=DIR --cases=300 --seed=1
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local dist = require "fsdp.distributed"
local json = require "fsdp.json"
local fio = require "fsdp.io"
local ck = require "fsdp.checkpoint"
local format = require "fsdp.checkpoint.format"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local ncases = tonumber(opts.cases or 300)
local seed = tonumber(opts.seed or 1)
local rank = dist.rank()

-- a small PRNG of our own (the same sequence on every rank)
local state = seed * 2654435761 % 4294967296
local function rand(n)   -- 1..n
  state = (state * 1103515245 + 12345) % 2147483648
  return math.floor(state / 65536) % n + 1
end

local model, sh, opt = common.sharded { policy = "block" }
if rank == 0 then
  fio.remove_tree(dir)
  fio.mkdirs(dir)
end
dist.barrier()
local loader = common.loader(3)
for _ = 1, 2 do common.step(model, sh, opt, loader) end
local good = dir .. "/good"
ck.save(good, { model = sh, optim = opt, step = 2 })

-- what this rank holds: its parameter slices and their AdamW state
local function snapshot()
  local s = { step_count = opt.step_count, segs = {} }
  for i, seg in ipairs(sh.segments) do
    local st = opt.state[seg.tensor]
    s.segs[i] = { seg.tensor:clone(), st.exp_avg:clone(), st.exp_avg_sq:clone(), st.step }
  end
  return s
end

local function restore(s)
  fsdp.no_grad(function()
    for i, seg in ipairs(sh.segments) do
      local st = opt.state[seg.tensor]
      seg.tensor:copy(s.segs[i][1])
      st.exp_avg:copy(s.segs[i][2])
      st.exp_avg_sq:copy(s.segs[i][3])
      st.step = s.segs[i][4]
    end
  end)
  opt.step_count = s.step_count
end

local function same_bits(a, b)
  if a:numel() ~= b:numel() then return false end
  local x, y = a:view(-1):tolist(), b:view(-1):tolist()
  for i = 1, #x do
    if x[i] ~= y[i] and not (x[i] ~= x[i] and y[i] ~= y[i]) then return false end
  end
  return true
end

-- elements (and fields) of this rank's state that differ from snapshot s
local function differences(s, ids)
  local n = opt.step_count == s.step_count and 0 or 1
  for i, seg in ipairs(sh.segments) do
    local st = opt.state[seg.tensor]
    local r = s.segs[i]
    if not st or st.step ~= r[4] then
      n = n + 1
    else
      if not same_bits(seg.tensor, r[1]) then n = n + 1 end
      if not same_bits(st.exp_avg, r[2]) or not same_bits(st.exp_avg_sq, r[3]) then n = n + 1 end
      -- a failed load must not even replace the state tensors
      if ids and st.exp_avg ~= ids[i] then n = n + 1 end
    end
  end
  return n
end

-- the pristine load, from a state that differs from the checkpoint
common.step(model, sh, opt, loader)
ck.load(good, { model = sh, optim = opt })
local pristine = snapshot()
common.step(model, sh, opt, loader)
local sentinel = snapshot()   -- what every case starts from
t.ok(differences(pristine) > 0, "the sentinel state differs from the checkpoint's")

local index = ck.read_index(good)
local names = fio.list_dir(good)

-- ---- the edits (rank 0 applies them to a fresh copy) ----

local function read(path) return fio.read_file(path) end
local function write(path, s)   -- no fsync: a scratch copy
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local function replace_at(s, i, c) return s:sub(1, i - 1) .. c .. s:sub(i + 1) end

-- every range of the index: { list, i } of parameters and optimizer state
local function all_ranges(idx)
  local l = {}
  for _, p in ipairs(idx.params) do
    for i = 1, #p.ranges do l[#l + 1] = { p.ranges, i, p } end
  end
  for _, e in ipairs(idx.optimizer.params) do
    for _, nm in ipairs(idx.optimizer.states) do
      for i = 1, #e[nm] do l[#l + 1] = { e[nm], i } end
    end
  end
  return l
end

local text_edits = {
  digit = function(s)
    local pos = {}
    for i = 1, #s do if s:sub(i, i):match("%d") then pos[#pos + 1] = i end end
    local i = pos[rand(#pos)]
    local d = (tonumber(s:sub(i, i)) + rand(9)) % 10
    return replace_at(s, i, tostring(d))
  end,
  bit = function(s)
    local i = rand(#s)
    return replace_at(s, i, string.char(bit.bxor(s:byte(i), bit.lshift(1, rand(8) - 1))))
  end,
  cut = function(s) local i = rand(#s) return s:sub(1, i - 1) .. s:sub(i + 1) end,
  add = function(s)
    local chars = ' 0,:"}a'
    local i, j = rand(#s), rand(#chars)
    return s:sub(1, i) .. chars:sub(j, j) .. s:sub(i + 1)
  end,
  truncate = function(s) return s:sub(1, rand(#s) - 1) end,
}

local forgeries = {
  offset = function(idx)
    local r = all_ranges(idx)[rand(#all_ranges(idx))]
    local x = r[1][r[2]]
    x.offset = math.max(0, x.offset + ({ -128, -64, -4, -1, 1, 4, 64, 128 })[rand(8)])
  end,
  start = function(idx)
    local r = all_ranges(idx)[rand(#all_ranges(idx))]
    local x = r[1][r[2]]
    x.start = math.max(0, x.start + ({ -16, -1, 1, 16 })[rand(4)])
  end,
  count = function(idx)
    local r = all_ranges(idx)[rand(#all_ranges(idx))]
    local x = r[1][r[2]]
    x.count = math.max(1, x.count + ({ -16, -1, 1, 16 })[rand(4)])
  end,
  file = function(idx)
    local r = all_ranges(idx)[rand(#all_ranges(idx))]
    local x = r[1][r[2]]
    x.file = x.file == "rank_00000.bin" and "rank_00001.bin" or "rank_00000.bin"
  end,
  swap_offsets = function(idx)   -- two blobs trade places (within a file when they can)
    local l = all_ranges(idx)
    local a = l[rand(#l)][1]
    local b = l[rand(#l)][1]
    local x, y = a[1], b[1]
    x.offset, y.offset = y.offset, x.offset
    x.file, y.file = y.file, x.file
  end,
  checksum = function(idx)
    local l = all_ranges(idx)
    local x = l[rand(#l)]
    local y = l[rand(#l)]
    x[1][x[2]].checksum = y[1][y[2]].checksum
  end,
  drop_range = function(idx)
    local l = all_ranges(idx)
    local r = l[rand(#l)]
    table.remove(r[1], r[2])
  end,
  duplicate_range = function(idx)
    local l = all_ranges(idx)
    local r = l[rand(#l)]
    local c = {}
    for k, v in pairs(r[1][r[2]]) do c[k] = v end
    r[1][#r[1] + 1] = c
  end,
  file_bytes = function(idx)
    local fe = idx.files[rand(#idx.files)]
    fe.bytes = math.max(0, fe.bytes + ({ -64, -1, 1, 64 })[rand(4)])
  end,
  shape = function(idx)
    local p = idx.params[rand(#idx.params)]
    if #p.shape == 2 then p.shape[1], p.shape[2] = p.shape[2], p.shape[1] else p.shape[1] = p.shape[1] + 1 end
  end,
}

local shard_edits = {
  bit = function(c, name)
    local s = read(c .. "/" .. name)
    local i = rand(#s)
    write(c .. "/" .. name, replace_at(s, i, string.char(bit.bxor(s:byte(i), bit.lshift(1, rand(8) - 1)))))
  end,
  truncate = function(c, name)
    local s = read(c .. "/" .. name)
    write(c .. "/" .. name, s:sub(1, rand(#s) - 1))
  end,
  append = function(c, name)
    local s = read(c .. "/" .. name)
    write(c .. "/" .. name, s .. string.rep("\0", rand(100)))
  end,
  remove = function(c, name) os.remove(c .. "/" .. name) end,
  swap_files = function(c)
    local a, b = read(c .. "/rank_00000.bin"), read(c .. "/rank_00001.bin")
    write(c .. "/rank_00000.bin", b)
    write(c .. "/rank_00001.bin", a)
  end,
  extra_file = function(c) write(c .. "/notes.txt", "not part of the checkpoint") end,
}

local function keys(tbl)
  local l = {}
  for k in pairs(tbl) do l[#l + 1] = k end
  table.sort(l)
  return l
end
local text_names, forge_names, shard_names = keys(text_edits), keys(forgeries), keys(shard_edits)

-- rank 0: a copy of good with case k's edit; returns its kind
local function make_case(copy)
  fio.remove_tree(copy)
  fio.mkdirs(copy)
  for _, n in ipairs(names) do write(copy .. "/" .. n, read(good .. "/" .. n)) end
  local family = rand(3)
  if family == 1 then
    local nm = text_names[rand(#text_names)]
    write(copy .. "/index.json", text_edits[nm](read(copy .. "/index.json")))
    return "index." .. nm
  elseif family == 2 then
    local nm = forge_names[rand(#forge_names)]
    local idx = json.decode(read(copy .. "/index.json"))
    forgeries[nm](idx)
    write(copy .. "/index.json", format.encode_index(idx))
    return "forged." .. nm
  else
    local nm = shard_names[rand(#shard_names)]
    shard_edits[nm](copy, index.files[rand(#index.files)].name)
    return "shard." .. nm
  end
end

-- ---- the cases ----
local counts = { errors = 0, identical = 0, silent = 0, touched = 0 }
local by_kind = {}
local copy = dir .. "/case"
local first_bad
for k = 1, ncases do
  local kind = dist.broadcast(rank == 0 and make_case(copy) or "")   -- (rank 0 draws and edits)
  restore(sentinel)
  local ids = {}
  for i, seg in ipairs(sh.segments) do ids[i] = opt.state[seg.tensor].exp_avg end
  local ok, err = pcall(ck.load, copy, { model = sh, optim = opt })
  local e = by_kind[kind] or { 0, 0 }
  by_kind[kind] = e
  if ok then
    local d = dist.sum(differences(pristine))
    if d == 0 then
      counts.identical = counts.identical + 1
      e[2] = e[2] + 1
    else
      counts.silent = counts.silent + 1
      if rank == 0 then print(string.format("SILENT DIFFERENCE: case %d (%s): %d differences", k, kind, d)) end
    end
  else
    counts.errors = counts.errors + 1
    e[1] = e[1] + 1
    local d = dist.sum(differences(sentinel, ids))
    if d > 0 then
      counts.touched = counts.touched + 1
      if rank == 0 then print(string.format("TOUCHED: case %d (%s) failed but changed the model: %s", k, kind, err)) end
    end
    local msg = tostring(err)
    if not msg:find(copy, 1, true) then
      counts.unnamed = (counts.unnamed or 0) + 1
      if rank == 0 then print(string.format("NO PATH: case %d (%s): %s", k, kind, msg)) end
    end
    if kind:match("^index%.") then   -- named down to the entry when the edit hit one
      counts.index_errors = (counts.index_errors or 0) + 1
      if msg:find("parameter '", 1, true) or msg:find("optimizer state", 1, true) then
        counts.index_named = (counts.index_named or 0) + 1
      end
    end
    -- damage in a shard file is named down to the tensor it hits
    if kind:match("^shard%.") and not (msg:find("parameter '", 1, true) or msg:find("optimizer state", 1, true)) then
      counts.no_tensor = (counts.no_tensor or 0) + 1
      if rank == 0 then print(string.format("NO TENSOR: case %d (%s): %s", k, kind, msg)) end
    end
  end
end

if rank == 0 then
  print(string.format("fuzz.checkpoint: %d cases (seed %d): %d errors, %d loaded bit-identical, %d silent differences, "
    .. "%d touched the model on error, %d errors without the file's path, 0 crashes", ncases, seed, counts.errors,
    counts.identical, counts.silent, counts.touched, counts.unnamed or 0))
  print(string.format("  of %d errors from edits of index.json, %d name the edited parameter entry (the rest hit "
    .. "other fields, whitespace, or left no JSON)", counts.index_errors or 0, counts.index_named or 0))
  for _, kind in ipairs(keys(by_kind)) do
    print(string.format("  %-24s %4d errors %4d identical", kind, by_kind[kind][1], by_kind[kind][2]))
  end
end
t.eq(counts.silent, 0, "no edit loads silently different state")
t.eq(counts.touched, 0, "no failed load touches the model or the optimizer")
t.eq(counts.unnamed or 0, 0, "every error names the checkpoint's file")
t.eq(counts.no_tensor or 0, 0, "every error about a shard file names the tensor")
t.ok(counts.errors + counts.identical == ncases and counts.errors > ncases / 2, "every case ended one way or the other")
-- the pristine checkpoint still loads
ck.load(good, { model = sh, optim = opt })
t.eq(dist.sum(differences(pristine)), 0, "the pristine checkpoint loads after all that")
t.done()
