-- fsdp.checkpoint.read: a load, on any number of ranks and any wrap
-- policy (resharding). Each rank plans the blobs holding its slices, reads
-- them file by file through a staging buffer, verifies them, and only
-- after every rank succeeded copies them into the model and the optimizer.
-- A blob is always read whole, so that its checksum covers every byte
-- taken from it: on as many ranks as saved (or fewer) that is exactly what
-- a rank needs; on more, a blob split between ranks is read by each of them.
local ffi = require "ffi"
local fsdp = require "fsdp"
local json = require "fsdp.json"
local fio = require "fsdp.io"
local common = require "fsdp.checkpoint.common"
local format = require "fsdp.checkpoint.format"

local core = require "fsdp.core"
local C, raise = core.C, core.raise
local fmt, concat, sort = string.format, table.concat, table.sort
local floor, min, max = math.floor, math.min, math.max
local together, describe, optim_kind, shape_str = common.together, common.describe, common.optim_kind,
  common.shape_str
local check_state = common.check_state
local ALIGN = format.ALIGN

local M = {}

M.stage_bytes = 64 * 1048576     -- read-staging buffer of a load

-- A staging buffer for reads (host memory outside the engine's allocator).
local function new_buffer(n) return ffi.new("uint8_t[?]", n) end

-- ---- load ----

local function with_stage(nbytes, fn)
  local ok, p = pcall(new_buffer, nbytes)
  if not ok then error(fmt("cannot allocate a %d-byte read buffer: %s", nbytes, tostring(p)), 0) end
  local okc, err = pcall(fn, p)
  if not okc then error(err, 0) end
end

-- Plans reads of element range [start, start + count) of a tensor stored as
-- `ranges` into dst (a float pointer). reads[file][blob] = the blob (one
-- range of the index, read and verified whole) and the pieces of it to copy
-- out: { src (byte in the blob), n, dst }.
local function plan_reads(reads, ranges, start, count, dst, label, where)
  local covered = 0
  local stop = start + count
  for _, r in ipairs(ranges) do
    local a, b = max(start, r.start), min(stop, r.start + r.count)
    if a < b then
      local l = reads[r.file]
      if not l then
        l = {}
        reads[r.file] = l
      end
      local e = l[r]
      if not e then
        e = { blob = r, pieces = {} }
        l[r] = e
      end
      e.pieces[#e.pieces + 1] = { src = 4 * (a - r.start), n = 4 * (b - a),
        dst = ffi.cast("uint8_t *", dst) + 4 * (a - start) }
      covered = covered + (b - a)
    end
  end
  if covered ~= count then
    error(fmt("%s: %s elements [%d, %d) are not all in the checkpoint's files", where, label, start, stop), 0)
  end
end

-- Reads the planned blobs of one file through stage, each whole, checking
-- it against its checksum, and copies the planned pieces out of it.
-- Returns the bytes read.
local function read_file(dir, fe, blobs, stage, stage_bytes, hasher, report)
  local path = dir .. "/" .. fe.name
  local list = {}
  for _, e in pairs(blobs) do list[#list + 1] = e end
  sort(list, function(x, y) return x.blob.offset < y.blob.offset end)
  local okf, f = pcall(fio.open, path, "r")
  if not okf then error(fmt("%s: cannot open: %s (it holds %s)", path, f, list[1].blob.label), 0) end
  local ok, rerr = pcall(function()
    local size = f:size()
    if size ~= fe.bytes then
      error(fmt("%s: the file has %d bytes, index.json says %d (truncated or replaced; it holds %s)", path, size,
        fe.bytes, list[1].blob.label), 0)
    end
    for _, e in ipairs(list) do
      local r = e.blob
      local nbytes = format.padded(4 * r.count)
      hasher:reset()
      local at = 0
      while at < nbytes do
        local len = min(stage_bytes, nbytes - at)
        local got = f:pread(stage, len, r.offset + at)
        if got ~= len then
          error(fmt("%s: short read at byte %d (the file shrank?), in %s", path, r.offset + at + got, r.label), 0)
        end
        hasher:update(stage, len)
        for _, pc in ipairs(e.pieces) do   -- the parts of the pieces inside [at, at + len)
          local lo, hi = max(at, pc.src), min(at + len, pc.src + pc.n)
          if lo < hi then ffi.copy(pc.dst + (lo - pc.src), stage + (lo - at), hi - lo) end
        end
        at = at + len
      end
      if hasher:hex() ~= r.checksum then
        error(fmt("%s: checksum mismatch in bytes [%d, %d): the file is corrupted, in %s", path, r.offset,
          r.offset + nbytes, r.label), 0)
      end
      report(nbytes)
    end
  end)
  f:close()
  if not ok then error(rerr, 0) end
end

local function run_reads(dir, index, reads, opts)
  local names, total = {}, 0
  local biggest = 0
  for name, blobs in pairs(reads) do
    names[#names + 1] = name
    for _, e in pairs(blobs) do
      local n = format.padded(4 * e.blob.count)
      total = total + n
      biggest = max(biggest, n)
    end
  end
  sort(names)
  if #names == 0 then return end
  local stage_bytes = min(biggest, max(ALIGN, M.stage_bytes - M.stage_bytes % ALIGN))
  local progress = common.progress(opts, "load", total)
  local done = 0
  local function report(n)
    done = done + n
    progress(done)
  end
  local hasher = fio.hasher()
  with_stage(stage_bytes, function(stage)
    for _, name in ipairs(names) do
      read_file(dir, index.file_map[name], reads[name], stage, stage_bytes, hasher, report)
    end
  end)
end

-- Everything this rank needs, read and verified into fresh tensors.
local function read_state(dir, index, d, opt, opts)
  local where = "fsdp.checkpoint.load: " .. dir
  local ipath = dir .. "/index.json"
  -- the model must match the checkpoint, parameter by parameter
  local mine = {}
  for _, p in ipairs(d.params) do
    mine[p.path] = true
    local e = index.param_map[p.path]
    if not e then
      local sample = index.params[1] and index.params[1].path or "none"
      error(fmt("%s: parameter '%s' is not in the checkpoint (%s holds %d parameters, e.g. '%s'): "
        .. "saved from another model?", where, p.path, ipath, #index.params, sample), 0)
    end
    local same = #e.shape == #p.shape
    for i = 1, #p.shape do same = same and e.shape[i] == p.shape[i] end
    if not same then
      error(fmt("%s: parameter '%s' has shape %s in %s, the model expects %s", where, p.path, shape_str(e.shape),
        ipath, shape_str(p.shape)), 0)
    end
  end
  if not (opts and opts.strict == false) then
    for _, e in ipairs(index.params) do
      if not mine[e.path] then
        error(fmt("%s: %s holds parameter '%s' %s, which the model lacks (pass strict = false to ignore it)", where,
          ipath, e.path, shape_str(e.shape)), 0)
      end
    end
  end
  local reads = {}
  local vals = {}
  for i, s in ipairs(d.segments) do
    -- read into host memory; copied into the shard (on its device) at commit
    local t = fsdp.empty({ s.count }, { dtype = "f32", tag = "other", device = "cpu" })
    vals[i] = t
    plan_reads(reads, index.param_map[s.path].ranges, s.start, s.count, t:data_ptr(), "parameter '" .. s.path .. "'",
      where)
  end
  local ostate
  if opt then
    local kind, names = optim_kind(opt, "fsdp.checkpoint.load")
    local o = index.optimizer
    if not o then
      error(fmt("%s: %s has no optimizer state (saved without optim); pass no optim to load the model only", where,
        ipath), 0)
    end
    if o.type ~= kind then
      error(fmt("%s: the checkpoint's optimizer is %s (%s), this one is %s", where, o.type, ipath, kind), 0)
    end
    ostate = {}
    for i, s in ipairs(d.segments) do
      local e = o.param_map[s.path]
      if e then
        local st = { step = e.step }
        local shape = s.key:shape()
        for _, nm in ipairs(names) do
          if e[nm] then
            local t = fsdp.empty(shape, { dtype = "f32", tag = "optimizer", device = "cpu" })
            plan_reads(reads, e[nm], s.start, s.count, t:data_ptr(), fmt("optimizer state %s of '%s'", nm, s.path),
              where)
            st[nm] = t   -- moved to the parameter's device after the reads (run_reads fills it first)
          end
        end
        ostate[i] = st
      end
    end
  end
  run_reads(dir, index, reads, opts)
  if ostate then   -- optimizer state lives where its parameter does
    for i, st in pairs(ostate) do
      local dev = d.segments[i].key:device()
      for nm, t in pairs(st) do
        if type(t) ~= "number" and t:device() ~= dev then
          st[nm] = t:to(dev)
          t:free()
        end
      end
    end
  end
  return vals, ostate
end

-- After every rank read and verified: into the model and the optimizer.
local function commit(d, index, vals, ostate, opt, opts)
  fsdp.no_grad(function()
    for i, s in ipairs(d.segments) do
      s.flat:copy(vals[i])
      vals[i]:free()
    end
  end)
  if d.sharded then
    -- gathered buffers (the root stays gathered between steps) hold old values
    for _, u in ipairs(d.sharded.units) do C.fsdp_unit_reshard(d.sharded.sched, u.index) end
  end
  if opt then
    local kind = optim_kind(opt, "fsdp.checkpoint.load")
    for i, s in ipairs(d.segments) do
      local st = ostate[i]
      if st and kind == "SGD" then st = { buf = st.buf } end
      opt.state[s.key] = st
    end
    local o = index.optimizer
    opt.step_count = o.step_count or opt.step_count
    if not (opts and opts.optim_hparams == false) and type(o.groups) == "table" and #o.groups == #opt.groups then
      for gi, g in ipairs(opt.groups) do
        for k, v in pairs(o.groups[gi]) do
          if k ~= "params" and type(v) ~= "table" then g[k] = v end
        end
      end
    end
  end
end

local function result(index)
  local function v(x) if x == json.null then return nil end return x end
  return { step = v(index.step), schedule = v(index.schedule), data = v(index.data), rng = v(index.rng),
    extra = v(index.extra), world_size = index.world_size, strategy = index.strategy, dir = index.dir, index = index }
end

--- fsdp.checkpoint.load(dir, state, opts) -> { step, schedule, data, rng,
-- extra, world_size, strategy, dir, index }. Collective. state.model (sharded
-- or nn module) gets its parameters, state.optim (optional) its state; the
-- checkpoint may come from any number of ranks and any wrap policy.
-- opts.strict (true): a checkpoint parameter the model lacks is an error;
-- opts.optim_hparams (true): restore the groups' lr, betas, ... as saved.
function M.load(dir, state, opts)
  local what = "fsdp.checkpoint.load"
  if type(dir) ~= "string" or dir == "" then raise(what .. ": dir must be a non-empty string") end
  dir = dir:gsub("/+$", "")
  check_state(state, what)
  local d = describe(state.model, what)
  local index, vals, ostate = together(d.comm, function()
    local ok, idx, v, o = pcall(function()
      local idx = format.read_index(dir)
      return idx, read_state(dir, idx, d, state.optim, opts)
    end)
    if not ok then
      idx = tostring(idx)
      error(idx:find("^fsdp%.checkpoint") and idx or (what .. ": " .. idx), 0)
    end
    return idx, v, o
  end)
  commit(d, index, vals, ostate, state.optim, opts)
  local info = result(index)
  info.residuals = require("fsdp.checkpoint.residuals").restore(dir, index, d, together)
  return info
end

M.commit = commit

return M
