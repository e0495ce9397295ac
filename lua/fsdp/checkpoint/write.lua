-- fsdp.checkpoint.write: a sharded save. Every writer rank (the first
-- replica group) writes its file rank_NNNNN.bin into dir.tmp, hashing as it
-- writes; rank 0 gathers their records, builds index.json and renames the
-- directory into place.
local ffi = require "ffi"
local fsdp = require "fsdp"
local json = require "fsdp.json"
local fio = require "fsdp.io"
local common = require "fsdp.checkpoint.common"
local format = require "fsdp.checkpoint.format"
local residuals = require "fsdp.checkpoint.residuals"

local raise = require("fsdp.core").raise
local fmt, sort = string.format, table.sort
local floor, max = math.floor, math.max
local together, describe, optim_kind = common.together, common.describe, common.optim_kind
local gather_strings, check_state = common.gather_strings, common.check_state
local on_host, check_f32, group_hparams = common.on_host, common.check_f32, common.group_hparams
local new_hasher, check_tiling = format.new_hasher, format.check_tiling
local sumsq = require("fsdp.guard").sumsq
local ALIGN = format.ALIGN

local M = {}

local u8p = ffi.typeof("const uint8_t *")
local is_dir = fio.is_dir

local function remove_tree(path)
  if path == "" or path == "/" then error("refusing to remove '" .. path .. "'", 0) end
  fio.remove_tree(path)
end
M.remove_tree = remove_tree

-- ---- save ----

-- A shard file being written: blobs at multiples of ALIGN, hashed as written.
local function new_out(path)
  local ok, f = pcall(fio.open, path, "w")
  if not ok then error(f, 0) end
  return { f = f, path = path, pos = 0, hasher = new_hasher(), tail = ffi.new("uint8_t[?]", ALIGN) }
end

local kill_hook = os.getenv("FSDP_TEST_KILL_DURING_SAVE") == "1"
local kill_publish = os.getenv("FSDP_TEST_KILL_DURING_SAVE") == "publish"

-- Writes n bytes at ptr as one blob; returns its offset in the file and
-- the checksum of the blob (its padded extent).
local function put(o, ptr, n)
  local off = o.pos
  local body = n - n % ALIGN
  local p = ffi.cast(u8p, ptr)
  if kill_hook and fsdp.rank() == 1 and body > 0 then
    -- test hook: die with part of the file written (tests/distributed/test_ckpt_kill.lua)
    o.f:append(p, floor(body / 2))
    io.stderr:write("checkpoint test hook: rank 1 killed during save\n")
    os.exit(9)
  end
  o.hasher:begin_blob()
  if body > 0 then
    o.f:append(p, body)
    o.hasher:update(p, body)
  end
  local rest = n - body
  if rest > 0 then
    ffi.fill(o.tail, ALIGN, 0)
    ffi.copy(o.tail, p + body, rest)
    o.f:append(o.tail, ALIGN)
    o.hasher:update(o.tail, ALIGN)
  end
  o.pos = off + body + (rest > 0 and ALIGN or 0)
  return off, o.hasher:blob_hex()
end

local function finish_out(o)
  local ok, err = pcall(function() o.f:sync() end)
  local f = o.f
  o.f = nil
  f:close()
  if not ok then error(err, 0) end
  return o.hasher:file_hex(o.pos)
end

-- (the compression residuals' files use the same blob writer)
M.blob_writer = { new = function(path) return new_out(path) end, put = function(o, p, n) return put(o, p, n) end,
  finish = function(o) return finish_out(o) end }

-- This rank's file: parameter slices, then optimizer state slices. Returns
-- the record for index.json.
local function write_shard(d, opt, tmp, opts)
  local name = fmt("rank_%05d.bin", d.file_id)
  local names = opt and select(2, optim_kind(opt, "fsdp.checkpoint.save")) or {}
  -- the bytes this file will hold, for progress reports
  local total = 0
  for _, s in ipairs(d.segments) do
    local blobs = 1
    local st = opt and opt.state[s.key]
    for _, nm in ipairs(names) do if st and st[nm] then blobs = blobs + 1 end end
    total = total + blobs * format.padded(4 * s.count)
  end
  local report = common.progress(opts, "save", total)
  local o = new_out(tmp .. "/" .. name)
  local rec = { file = name, params = {}, optim = {} }
  local ok, err = pcall(function()
    for _, s in ipairs(d.segments) do
      local h = on_host(s.flat)
      local off, sum = put(o, h:read_ptr(), 4 * s.count)
      if h ~= s.flat then h:free() end   -- (also keeps the copy alive until put is done)
      rec.params[#rec.params + 1] = { s.path, s.start, s.count, off, sum }
      report(o.pos)
    end
    if opt then
      for _, s in ipairs(d.segments) do
        local st = opt.state[s.key]
        if st then
          for _, nm in ipairs(names) do
            local t = st[nm]
            if t then
              check_f32(t, "fsdp.checkpoint.save: optimizer state " .. nm .. " of " .. s.path)
              if t:numel() ~= s.count then
                error(fmt("optimizer state %s of '%s' has %d elements, its parameter slice %d", nm, s.path,
                  t:numel(), s.count), 0)
              end
              local h = on_host(t)
              local off, sum = put(o, h:read_ptr(), 4 * s.count)
              if h ~= t then h:free() end
              rec.optim[#rec.optim + 1] = { s.path, nm, s.start, s.count, off, st.step or opt.step_count or 0, sum }
              report(o.pos)
            end
          end
        end
      end
    end
    rec.checksum = finish_out(o)
    rec.bytes = o.pos
  end)
  if not ok then
    if o.f then o.f:close() end
    error(err, 0)
  end
  return rec
end

local function ranges_sorted(list)
  sort(list, function(a, b) return a.start < b.start end)
  return json.array(list)
end

-- Rank 0: the index from every writer's record.
local function build_index(d, state, opt, texts)
  local records = {}
  for i, text in ipairs(texts) do records[i] = json.decode(text) end
  local index = {
    format = format.FORMAT, version = format.VERSION,
    world_size = d.world, num_files = d.nfiles, strategy = d.strategy, group_size = d.group_size,
    model = { type = d.model.__name, num_params = #d.params },
    step = state.step, schedule = state.schedule, data = state.data, rng = state.rng, extra = state.extra,
    run = state.run,
    checksum = { algorithm = format.CHECKSUM },
    files = json.array({}), params = json.array({}),
  }
  local pranges, oranges, osteps = {}, {}, {}
  local total = 0
  for _, rec in ipairs(records) do
    if rec.file then
      index.files[#index.files + 1] = { name = rec.file, bytes = rec.bytes, checksum = rec.checksum }
      for _, e in ipairs(rec.params) do
        pranges[e[1]] = pranges[e[1]] or {}
        local l = pranges[e[1]]
        l[#l + 1] = { file = rec.file, start = e[2], count = e[3], offset = e[4], checksum = e[5] }
      end
      for _, e in ipairs(rec.optim) do
        local key = e[1] .. "\0" .. e[2]
        oranges[key] = oranges[key] or {}
        local l = oranges[key]
        l[#l + 1] = { file = rec.file, start = e[3], count = e[4], offset = e[5], checksum = e[7] }
        osteps[e[1]] = max(osteps[e[1]] or 0, e[6])
      end
    end
  end
  sort(index.files, function(a, b) return a.name < b.name end)
  for _, p in ipairs(d.params) do
    local ranges = ranges_sorted(pranges[p.path] or {})
    check_tiling(ranges, p.numel, "fsdp.checkpoint.save: parameter '" .. p.path .. "'")
    index.params[#index.params + 1] = { path = p.path, shape = json.array(p.shape), dtype = "F32", numel = p.numel,
      ranges = ranges }
    total = total + p.numel
  end
  index.model.numel = total
  if opt then
    local kind, names = optim_kind(opt, "fsdp.checkpoint.save")
    local o = { type = kind, step_count = opt.step_count or 0, states = json.array(names), groups = json.array({}),
      params = json.array({}) }
    for _, g in ipairs(opt.groups) do o.groups[#o.groups + 1] = group_hparams(g) end
    for _, p in ipairs(d.params) do
      if osteps[p.path] then
        local e = { path = p.path, step = osteps[p.path] }
        for _, nm in ipairs(names) do
          local l = oranges[p.path .. "\0" .. nm]
          if l then
            e[nm] = ranges_sorted(l)
            check_tiling(e[nm], p.numel, "fsdp.checkpoint.save: optimizer state " .. nm .. " of '" .. p.path .. "'")
          end
        end
        o.params[#o.params + 1] = e
      end
    end
    index.optimizer = o
  end
  return index
end

-- NaN or infinity in what this rank would write is refused: a checkpoint
-- of non-finite state would replace a good one (and retention drop it).
local function check_finite(d, opt, what)
  local list, names = {}, opt and select(2, optim_kind(opt, what)) or {}
  for _, s in ipairs(d.segments) do
    list[#list + 1] = s.flat
    local st = opt and opt.state[s.key]
    for _, nm in ipairs(names) do if st and st[nm] then list[#list + 1] = st[nm] end end
  end
  local total = sumsq(list)
  if total == total and total ~= math.huge then return end
  for _, s in ipairs(d.segments) do   -- name the first tensor that is not finite
    local st, label = opt and opt.state[s.key], nil
    local v = sumsq({ s.flat })
    if v ~= v or v == math.huge then label = fmt("parameter '%s'", s.path) end
    for _, nm in ipairs(names) do
      if not label and st and st[nm] then
        v = sumsq({ st[nm] })
        if v ~= v or v == math.huge then label = fmt("optimizer state %s of '%s'", nm, s.path) end
      end
    end
    if label then
      error(fmt("%s: %s holds NaN or infinity on rank %d: a checkpoint of non-finite state is refused "
        .. "(nothing was written)", what, label, d.rank), 0)
    end
  end
  error(fmt("%s: the state holds NaN or infinity on rank %d: refused (nothing was written)", what, d.rank), 0)
end

-- Rank 0, after every rank wrote and synced its file: the index, then the
-- directory into place (an older one of the same name goes aside first).
local function publish(dir, tmp, index, what)
  fio.write_atomic(format.index_path(tmp), format.encode_index(index))
  fio.sync_path(tmp)
  local old = dir .. ".old"
  if is_dir(dir) then
    remove_tree(old)
    local okr, e = pcall(fio.rename, dir, old)
    if not okr then error(fmt("%s: cannot move the old '%s' aside: %s", what, dir, tostring(e)), 0) end
    if kill_publish then   -- test hook: die between the renames (tests/distributed/test_ckpt_kill.lua)
      io.stderr:write("checkpoint test hook: rank 0 killed between the renames of a save\n")
      os.exit(9)
    end
  end
  local okr, e = pcall(fio.rename, tmp, dir)
  if not okr then error(fmt("%s: %s", what, tostring(e)), 0) end
  if is_dir(old) then remove_tree(old) end
end

-- ---- every file where the index says: one folder all writers share ----

-- Rank 0 marks the folder it creates with a token that every writer must
-- read back there before it writes: a writer on another filesystem (a
-- node-local disk) finds no folder, or a leftover of an earlier save.
local TOKEN_FILE = ".save_token"
local NODE_LOCAL = "every rank that writes must see the folder rank 0 publishes (one filesystem shared by the "
  .. "nodes); checkpoints on node-local disks are refused (docs/reliability.md)"

local function new_token(dir)
  local f = io.open("/dev/urandom", "rb")
  local bytes = f and f:read(8) or ""
  if f then f:close() end
  return fio.hash_string(bytes .. dir .. tostring(os.time()) .. tostring(os.clock()))
end

local function check_same_folder(tmp, token, rank, what)
  local path = tmp .. "/" .. TOKEN_FILE
  local ok, seen = pcall(fio.read_file, path)
  if not ok then
    error(fmt("%s: rank %d does not see %s, which rank 0 created: %s", what, rank, tmp, NODE_LOCAL), 0)
  end
  if seen ~= token then
    error(fmt("%s: rank %d sees another %s than rank 0 (a leftover of an earlier save on a disk rank 0 does not "
      .. "share): %s", what, rank, tmp, NODE_LOCAL), 0)
  end
end

-- The writer reads its file back (size and every blob's checksum) before
-- it says it is done: what the index will promise is what is there.
local function read_back(tmp, rec, what)
  local path = tmp .. "/" .. rec.file
  local blobs = {}
  for _, e in ipairs(rec.params) do blobs[#blobs + 1] = { off = e[4], n = format.padded(4 * e[3]), sum = e[5] } end
  for _, e in ipairs(rec.optim) do blobs[#blobs + 1] = { off = e[5], n = format.padded(4 * e[4]), sum = e[7] } end
  sort(blobs, function(a, b) return a.off < b.off end)
  local f = fio.open(path, "r")
  local ok, err = pcall(function()
    local size = f:size()
    if size ~= rec.bytes then error(fmt("%s has %d bytes after writing %d", path, size, rec.bytes), 0) end
    local stage_n = 4 * 1048576
    local stage = ffi.new("uint8_t[?]", stage_n)
    local h, sums = fio.hasher(), {}
    for i, b in ipairs(blobs) do
      h:reset()
      local at = 0
      while at < b.n do
        local len = math.min(stage_n, b.n - at)
        if f:pread(stage, len, b.off + at) ~= len then error(fmt("%s: short read at byte %d", path, b.off + at), 0) end
        h:update(stage, len)
        at = at + len
      end
      sums[i] = h:hex()
      if sums[i] ~= b.sum then error(fmt("%s: bytes [%d, %d) read back differently from what was written", path,
        b.off, b.off + b.n), 0) end
    end
    if format.file_checksum(sums, rec.bytes) ~= rec.checksum then
      error(fmt("%s: its checksum reads back differently from what was written", path), 0)
    end
  end)
  f:close()
  if not ok then error(fmt("%s: %s", what, tostring(err)), 0) end
end

-- Rank 0, before the index: each writer's file is in its folder, whole.
local function confirm_visible(tmp, rec, what)
  if not rec.file then return end
  local kind, bytes = fio.stat(tmp .. "/" .. rec.file)
  if kind ~= "file" or bytes ~= rec.bytes then
    error(fmt("%s: rank %d's file %s is %s in %s where rank 0 publishes (%d bytes written): %s", what, rec.rank,
      rec.file, kind ~= "file" and "missing" or fmt("%d bytes", bytes), tmp, rec.bytes, NODE_LOCAL), 0)
  end
end

--- fsdp.checkpoint.save(dir, state, opts) -> dir. Collective: every rank
-- calls it. state: model (sharded or nn module, required), optim, step,
-- schedule, data, rng, extra (the last five: JSON-able values, stored in
-- index.json as rank 0 has them). opts.progress: see fsdp.checkpoint.
function M.save(dir, state, opts)
  local what = "fsdp.checkpoint.save"
  if type(dir) ~= "string" or dir == "" then raise(what .. ": dir must be a non-empty string") end
  dir = dir:gsub("/+$", "")
  check_state(state, what)
  local d = describe(state.model, what)
  local comm, rank = d.comm, d.rank
  local opt = state.optim
  local tmp = dir .. ".tmp"
  local token = rank == 0 and new_token(dir) or ""
  -- fail early and alike on every rank when the state cannot be stored
  together(comm, function()
    if opt then optim_kind(opt, what) end
    check_finite(d, opt, what)
    for _, k in ipairs({ "step", "schedule", "data", "rng", "extra", "run" }) do
      local okk, e = pcall(json.encode, state[k])
      if not okk then error(fmt("%s: state.%s cannot be stored as JSON: %s", what, k, e), 0) end
    end
    if rank == 0 then
      remove_tree(tmp)   -- (a leftover of a killed save)
      fio.mkdirs(tmp)
      fio.write_atomic(tmp .. "/" .. TOKEN_FILE, token)
    end
  end)
  token = require("fsdp.distributed")._borrow(comm):broadcast(token)
  local ok, err = pcall(function()
    local rec = together(comm, function()
      if not d.writer then return {} end
      check_same_folder(tmp, token, rank, what)
      local r = write_shard(d, opt, tmp, opts)
      read_back(tmp, r, what)
      r.rank = rank
      return r
    end)
    local records = gather_strings(comm, json.encode(rec))
    local rrec = together(comm, function() return residuals.write(d, tmp, M.blob_writer) or {} end)
    local rrecords = gather_strings(comm, json.encode(rrec))
    together(comm, function()
      if rank ~= 0 then return end
      for _, text in ipairs(records) do confirm_visible(tmp, json.decode(text), what) end
      for _, text in ipairs(rrecords) do confirm_visible(tmp, json.decode(text), what) end
      fio.remove_tree(tmp .. "/" .. TOKEN_FILE)
      local index = build_index(d, state, opt, records)
      index.compress = residuals.index_entry(d, rrecords)
      publish(dir, tmp, index, what)
    end)
  end)
  if not ok then
    if rank == 0 then remove_tree(tmp) end   -- every rank failed alike: nothing writes there now
    error(err, 0)
  end
  return dir
end

return M
