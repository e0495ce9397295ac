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
  end
  local okr, e = pcall(fio.rename, tmp, dir)
  if not okr then error(fmt("%s: %s", what, tostring(e)), 0) end
  if is_dir(old) then remove_tree(old) end
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
  -- fail early and alike on every rank when the state cannot be stored
  together(comm, function()
    if opt then optim_kind(opt, what) end
    check_finite(d, opt, what)
    for _, k in ipairs({ "step", "schedule", "data", "rng", "extra" }) do
      local okk, e = pcall(json.encode, state[k])
      if not okk then error(fmt("%s: state.%s cannot be stored as JSON: %s", what, k, e), 0) end
    end
    if rank == 0 then
      remove_tree(tmp)
      fio.mkdirs(tmp)
    end
  end)
  local ok, err = pcall(function()
    local rec = together(comm, function()
      if not d.writer then return {} end
      return write_shard(d, opt, tmp, opts)
    end)
    local records = gather_strings(comm, json.encode(rec))
    local rrec = together(comm, function() return residuals.write(d, tmp, M.blob_writer) or {} end)
    local rrecords = gather_strings(comm, json.encode(rrec))
    together(comm, function()
      if rank == 0 then
        local index = build_index(d, state, opt, records)
        index.compress = residuals.index_entry(d, rrecords)
        publish(dir, tmp, index, what)
      end
    end)
  end)
  if not ok then
    if rank == 0 then remove_tree(tmp) end   -- every rank failed alike: nothing writes there now
    error(err, 0)
  end
  return dir
end

return M
