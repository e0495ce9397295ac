-- fsdp.checkpoint.read: a load, on any number of ranks and any wrap
-- policy (resharding). Each rank plans the byte ranges holding its slices,
-- reads them file by file through a staging buffer, verifies them, and only
-- after every rank succeeded copies them into the model and the optimizer.
local ffi = require "ffi"
local fsdp = require "fsdp"
local json = require "fsdp.json"
local fio = require "fsdp.io"
local common = require "fsdp.checkpoint.common"
local format = require "fsdp.checkpoint.format"

local C = fsdp.C
local raise = fsdp.core.raise
local fmt, concat, sort = string.format, table.concat, table.sort
local floor, min, max = math.floor, math.min, math.max
local together, describe, optim_kind, shape_str = common.together, common.describe, common.optim_kind,
  common.shape_str
local chunk_hash = format.chunk_hash
local check_state = common.check_state
local ALIGN = format.ALIGN

local M = {}

M.stage_bytes = 64 * 1048576     -- read-staging buffer of a load

local function pread_all(f, ptr, n, off) return f:pread(ptr, n, off) end

-- A staging buffer for reads (host memory outside the engine's allocator).
local function new_buffer(n) return ffi.new("uint8_t[?]", n) end

-- ---- load ----

-- Plans reads of element range [start, start + count) of a tensor stored as
-- `ranges` into dst (a float pointer); pieces go to per-file lists.
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
      l[#l + 1] = { off = r.offset + 4 * (a - r.start), n = 4 * (b - a), dst = ffi.cast("uint8_t *", dst) + 4 * (a - start),
        label = fmt("%s elements [%d, %d)", label, a, b) }
      covered = covered + (b - a)
    end
  end
  if covered ~= count then
    error(fmt("%s: %s elements [%d, %d) are not all in the checkpoint's files", where, label, start, stop), 0)
  end
end

-- A chunk failed its checksum: which blobs in it are damaged? (Error path
-- only: each blob overlapping the chunk is read whole and checked.)
local function blame(f, fe, clo, chi)
  local found, near = {}, {}
  for _, b in ipairs(fe.blobs) do
    local padded = math.ceil(b.bytes / ALIGN) * ALIGN
    if b.offset < chi and b.offset + padded > clo then
      near[#near + 1] = b.label
      if type(b.checksum) == "string" and padded > 0 then
        local buf = new_buffer(padded)
        local got = pread_all(f, buf, padded, b.offset)
        if got ~= padded or chunk_hash(buf, padded) ~= b.checksum then found[#found + 1] = b.label end
      end
    end
  end
  local list = #found > 0 and found or near
  if #list > 4 then list = { list[1], list[2], list[3], fmt("%d more", #list - 3) } end
  return concat(list, ", ")
end

-- Reads the planned pieces of one file, verifying every chunk it touches.
local function read_file(dir, fe, pieces, chunk, stage, stage_bytes)
  local path = dir .. "/" .. fe.name
  sort(pieces, function(a, b) return a.off < b.off end)
  local okf, f = pcall(fio.open, path, "r")
  if not okf then error(fmt("%s: cannot open: %s (it holds %s)", path, f, pieces[1].label), 0) end
  local ok, rerr = pcall(function()
    local size = f:size()
    if size ~= fe.bytes then
      error(fmt("%s: the file has %d bytes, index.json says %d (truncated or replaced; it holds %s)", path, size,
        fe.bytes, pieces[1].label), 0)
    end
    -- the chunks needed, as runs of consecutive chunk numbers
    local runs = {}
    for _, pc in ipairs(pieces) do
      local c0, c1 = floor(pc.off / chunk), floor((pc.off + pc.n - 1) / chunk)
      local last = runs[#runs]
      if last and c0 <= last[2] + 1 then
        last[2] = max(last[2], c1)
      else
        runs[#runs + 1] = { c0, c1 }
      end
    end
    local per = max(1, floor(stage_bytes / chunk))
    local j = 1
    for _, run in ipairs(runs) do
      local c = run[1]
      while c <= run[2] do
        local cend = min(run[2], c + per - 1)
        local lo = c * chunk
        local hi = min(fe.bytes, (cend + 1) * chunk)
        local got = pread_all(f, stage, hi - lo, lo)
        if got ~= hi - lo then error(fmt("%s: short read at byte %d (the file shrank?)", path, lo + got), 0) end
        for ci = c, cend do
          local clo = ci * chunk
          local clen = min(chunk, fe.bytes - clo)
          if chunk_hash(stage + (clo - lo), clen) ~= fe.chunks[ci + 1] then
            error(fmt("%s: checksum mismatch in bytes [%d, %d): the file is corrupted, in %s", path, clo,
              clo + clen, blame(f, fe, clo, clo + clen)), 0)
          end
        end
        -- copy out the pieces overlapping [lo, hi)
        while j <= #pieces and pieces[j].off + pieces[j].n <= lo do j = j + 1 end
        local k = j
        while k <= #pieces and pieces[k].off < hi do
          local pc = pieces[k]
          local a, b = max(lo, pc.off), min(hi, pc.off + pc.n)
          if a < b then ffi.copy(pc.dst + (a - pc.off), stage + (a - lo), b - a) end
          k = k + 1
        end
        c = cend + 1
      end
    end
  end)
  f:close()
  if not ok then error(rerr, 0) end
end

local function with_stage(nbytes, fn)
  local ok, p = pcall(new_buffer, nbytes)
  if not ok then error(fmt("cannot allocate a %d-byte read buffer: %s", nbytes, tostring(p)), 0) end
  local okc, err = pcall(fn, p)
  if not okc then error(err, 0) end
end

local function run_reads(dir, index, reads, opts)
  local chunk = index.checksum.chunk_bytes
  local stage_bytes = max(chunk, floor(M.stage_bytes / chunk) * chunk)
  local names, total = {}, 0
  for name, pieces in pairs(reads) do
    names[#names + 1] = name
    for _, pc in ipairs(pieces) do total = total + pc.n end
  end
  sort(names)
  if #names == 0 then return end
  local report = common.progress(opts, "load", total)
  local done = 0
  with_stage(stage_bytes, function(stage)
    for _, name in ipairs(names) do
      read_file(dir, index.file_map[name], reads[name], chunk, stage, stage_bytes)
      for _, pc in ipairs(reads[name]) do done = done + pc.n end
      report(done)
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
  return result(index)
end

M.commit = commit

return M
