-- fsdp.checkpoint.export: one safetensors file of full tensors (f32),
-- with the model's own names or, through model:to_hf, Hugging Face's names
-- and layouts (GPT-2); and import of such a file into a sharded model or an
-- nn module. No rank ever holds the whole model: export gathers one unit at
-- a time and rank 0 writes each tensor at its place; import reads only this
-- rank's slices.
local ffi = require "ffi"
local fsdp = require "fsdp"
local json = require "fsdp.json"
local fio = require "fsdp.io"
local safetensors = require "fsdp.safetensors"
local common = require "fsdp.checkpoint.common"

local core = require "fsdp.core"
local C, raise = core.C, core.raise
local fmt, sort = string.format, table.sort
local floor, min, max = math.floor, math.min, math.max
local together, describe, numel_of, shape_str, on_host = common.together, common.describe, common.numel_of,
  common.shape_str, common.on_host
local parent_of = fio.parent

local M = {}

-- Stand-ins for tensors, handed to model:to_hf to learn its layout from the
-- shapes alone: each records the view ops applied to it.
local Proxy = {}
local proxy_methods = {}
Proxy.__index = function(_, k)
  local m = proxy_methods[k]
  if m then return m end
  error("fsdp.checkpoint: the model's to_hf uses tensor method '" .. tostring(k)
    .. "', which export/import cannot map from shapes (transpose, narrow and contiguous can)", 0)
end

local function proxy(path, shape, ops)
  return setmetatable({ _path = path, _shape = shape, _ops = ops or {} }, Proxy)
end

local function copy_list(l)
  local c = {}
  for i, v in ipairs(l) do c[i] = v end
  return c
end

function proxy_methods.transpose(t, a, b)
  a, b = a or 1, b or 2
  local s, ops = copy_list(rawget(t, "_shape")), copy_list(rawget(t, "_ops"))
  s[a], s[b] = s[b], s[a]
  ops[#ops + 1] = { "transpose", a, b }
  return proxy(rawget(t, "_path"), s, ops)
end
proxy_methods.t = proxy_methods.transpose
function proxy_methods.narrow(t, dim, start, len)
  local s, ops = copy_list(rawget(t, "_shape")), copy_list(rawget(t, "_ops"))
  if start < 1 or start + len - 1 > s[dim] then error("fsdp.checkpoint: to_hf narrows out of range", 0) end
  ops[#ops + 1] = { "narrow", dim, start, len, copy_list(s) }   -- [5]: the shape before
  s[dim] = len
  return proxy(rawget(t, "_path"), s, ops)
end
function proxy_methods.contiguous(t) return t end
function proxy_methods.shape(t) return copy_list(rawget(t, "_shape")) end
function proxy_methods.dim(t) return #rawget(t, "_shape") end
function proxy_methods.numel(t) return numel_of(rawget(t, "_shape")) end

-- { {name, path, shape (in the file), ops} } sorted by name: the layout of
-- the exported file.
local function export_layout(d, hf)
  local entries = {}
  if hf then
    if type(d.model.to_hf) ~= "function" then
      error("fsdp.checkpoint: hf = true needs a model with a to_hf method (GPT has one)", 0)
    end
    local sd = {}
    for _, p in ipairs(d.params) do sd[p.path] = proxy(p.path, copy_list(p.shape)) end
    local out = d.model:to_hf(sd)
    for name, px in pairs(out) do
      if getmetatable(px) ~= Proxy then error("fsdp.checkpoint: to_hf returned a non-tensor for " .. name, 0) end
      entries[#entries + 1] = { name = name, path = rawget(px, "_path"), shape = rawget(px, "_shape"),
        ops = rawget(px, "_ops") }
    end
  else
    for _, p in ipairs(d.params) do
      entries[#entries + 1] = { name = p.path, path = p.path, shape = copy_list(p.shape), ops = {} }
    end
  end
  sort(entries, function(a, b) return a.name < b.name end)
  return entries
end

local function apply_ops(t, ops)
  for _, op in ipairs(ops) do
    if op[1] == "transpose" then t = t:transpose(op[2], op[3]) else t = t:narrow(op[2], op[3], op[4]) end
  end
  return t:contiguous()
end

--- fsdp.checkpoint.export(path, model, opts): one safetensors file with the
-- full tensors (f32). Collective. Units are gathered one at a time (f32
-- masters, whatever the compute dtype) and rank 0 writes each tensor at its
-- place, computed up front from the shapes: no rank holds the whole model.
-- opts.hf: Hugging Face names and layouts through model:to_hf (GPT-2);
-- opts.metadata: extra string metadata.
function M.export(path, target, opts)
  local what = "fsdp.checkpoint.export"
  if type(path) ~= "string" or path == "" then raise(what .. ": path must be a non-empty string") end
  opts = opts or {}
  local d = describe(target, what)
  local layout = together(d.comm, export_layout, d, opts.hf)
  -- the header, from shapes alone
  local hdr, pos = {}, 0
  local by_path = {}
  for _, e in ipairs(layout) do
    local n = 4 * numel_of(e.shape)
    hdr[e.name] = { dtype = "F32", shape = json.array(copy_list(e.shape)), data_offsets = json.array({ pos, pos + n }) }
    e.offset = pos
    pos = pos + n
    by_path[e.path] = by_path[e.path] or {}
    local l = by_path[e.path]
    l[#l + 1] = e
  end
  local meta = json.object({ format = "pt", fsdp_layout = opts.hf and "hf" or "native",
    fsdp_model = tostring(d.model.__name) })
  if type(d.model.config) == "table" then
    for k, v in pairs(d.model.config) do
      if type(k) == "string" and (type(v) == "number" or type(v) == "string") then meta[k] = tostring(v) end
    end
  end
  for k, v in pairs(opts.metadata or {}) do meta[k] = tostring(v) end
  hdr.__metadata__ = meta
  local head = safetensors.encode_header(hdr)
  local data_start = #head
  local tmp = path .. ".tmp"
  local rank0 = d.rank == 0
  local fd, failure
  if rank0 then
    local ok, err = pcall(function()
      local dirp = parent_of(path)
      if dirp ~= "." then fio.mkdirs(dirp) end
      local okf, e = pcall(fio.open, tmp, "w")
      if not okf then error(fmt("%s: %s", what, e), 0) end
      fd = e
      fd:pwrite(head, #head, 0)
    end)
    if not ok then failure = err end
  end
  -- rank 0 writes one parameter (full f32 tensor t, model layout)
  local report = common.progress(rank0 and opts or nil, "export", pos)
  local written = 0
  local function emit(p, t)
    if failure then return end
    local ok, err = pcall(function()
      for _, e in ipairs(by_path[p.path] or {}) do
        local v = on_host(fsdp.no_grad(function() return apply_ops(t:view(p.shape), e.ops) end))
        fd:pwrite(v:read_ptr(), 4 * v:numel(), data_start + e.offset)
        written = written + 4 * v:numel()
        v:free()   -- (a view or a copy: only this reference goes; keeps it alive until the write is done)
        report(written)
      end
    end)
    if not ok then failure = err end
  end
  if d.sharded and d.writer then   -- the shard group holding rank 0 (other replicas hold the same)
    for _, u in ipairs(d.sharded.units) do
      local full = fsdp.empty({ u.padded }, { dtype = "f32", tag = "comm", device = u.master:device() })
      if C.fsdp_all_gather(nil, d.sharded.shard_comm, full, u.master, "checkpoint.export." .. u.name) ~= 0 then
        raise()
      end
      if rank0 then
        for i, p in ipairs(u.params) do emit(p, full:narrow(1, u.offsets[i] + 1, p.numel)) end
      end
      full:free()
    end
  elseif rank0 then
    for _, s in ipairs(d.segments) do emit({ path = s.path, shape = s.key:shape() }, s.flat) end
  end
  together(d.comm, function()
    if not rank0 then return end
    if failure then
      if fd then pcall(fd.close, fd) end
      pcall(fio.remove_tree, tmp)
      error(failure, 0)
    end
    local okf, e = pcall(function()
      fd:sync()
      fd:close()
    end)
    if not okf then
      pcall(fd.close, fd)
      error(what .. ": " .. tostring(e), 0)
    end
    local okr, er = pcall(fio.rename, tmp, path)
    if not okr then error(fmt("%s: %s", what, tostring(er)), 0) end
  end)
  return path
end

-- ---- import: each rank reads the byte ranges of its own slices ----

local BF16_BYTES, F32_BYTES = 2, 4
local file_elem = { F32 = F32_BYTES, BF16 = BF16_BYTES }
local file_dtype = { F32 = "f32", BF16 = "bf16" }

local function pread_exact(fd, ptr, nbytes, at, info, fname)
  if nbytes == 0 then return end
  local got = fd:pread(ptr, nbytes, at)
  if got ~= nbytes then
    error(fmt("%s: short read of tensor %q: %d of %d bytes at byte %d (the file shrank?)", info.path, fname, got,
      nbytes, at), 0)
  end
end

-- Every tensor handle a read makes (stagings and the views over them) is
-- freed as soon as the parameter is done, so that no staging waits for
-- Lua's collector while the next parameter is read.
local function scope()
  local made = {}
  local function keep(x)
    made[#made + 1] = x
    return x
  end
  local function close()
    for i = #made, 1, -1 do made[i]:free() end
  end
  return keep, close
end

-- A host tensor of the file's dtype to read into (tag other: what a load
-- stages is visible in the allocator's figures).
local function host_stage(keep, shape, dt)
  return keep(fsdp.empty(shape, { dtype = file_dtype[dt], tag = "other", device = "cpu" }))
end

-- Element range [a, a + n) of a parameter whose file tensor has the same
-- element order (possibly fewer rows: those the export cut come back as
-- zeros): one read of exactly that range, straight into dst when it is an
-- f32 host tensor.
local function read_same_order(fd, info, e, a, n, dst, keep)
  local te = info.tensors[e.fname]
  local esz = file_elem[te.dtype]
  local base = info.data_start + te.offsets[1]
  local m = max(0, min(n, numel_of(e.shape) - a))
  if m > 0 then
    local into = keep(dst:narrow(1, 1, m))
    if te.dtype == "F32" and dst:device() == "cpu" then
      pread_exact(fd, into:data_ptr(), esz * m, base + esz * a, info, e.fname)
    else
      local stage = host_stage(keep, { m }, te.dtype)
      pread_exact(fd, stage:data_ptr(), esz * m, base + esz * a, info, e.fname)
      into:copy(stage)
    end
  end
  if m < n then keep(dst:narrow(1, m + 1, n - m)):fill(0) end
end

-- Element range [a, a + n) of a (R, K) parameter stored transposed, (K, R),
-- in the file (HF's Conv1D). The range covers model rows r0..r1, which are
-- file columns r0..r1; for each file row c the elements wanted form one
-- run of columns, read into row c of a (K, r1 - r0 + 1) staging tensor.
-- The staging, read as its transpose, is the model's rows r0..r1, copied
-- out as (up to) three pieces: the tail of row r0, the full rows between,
-- the head of row r1. Only this rank's bytes are read, and the staging
-- holds at most min(n + 2 K, R K) elements.
local function read_transposed(fd, info, e, a, n, dst, keep)
  local te = info.tensors[e.fname]
  local esz = file_elem[te.dtype]
  local base = info.data_start + te.offsets[1]
  local K, R = e.shape[1], e.shape[2]            -- file (K, R); model (R, K)
  local last = a + n - 1
  local r0, r1 = floor(a / K), floor(last / K)
  local w = r1 - r0 + 1
  local stage = host_stage(keep, { K, w }, te.dtype)
  local sp = ffi.cast("uint8_t *", stage:data_ptr())
  for c = 0, K - 1 do
    local lo = r0 * K + c >= a and r0 or r0 + 1
    local hi = r1 * K + c <= last and r1 or r1 - 1
    if lo <= hi then
      pread_exact(fd, sp + esz * (c * w + lo - r0), esz * (hi - lo + 1), base + esz * (c * R + lo), info, e.fname)
    end
  end
  local rows = keep(stage:transpose(1, 2))        -- (w, K): model rows r0..r1
  local c0, c1 = a - r0 * K, last - r1 * K        -- first column of row r0, last of row r1
  -- dst elements [at, at + len) as (nrows, ncols) <- src
  local function put(at, nrows, ncols, src)
    keep(keep(dst:narrow(1, at + 1, nrows * ncols)):view({ nrows, ncols })):copy(src)
  end
  if w == 1 then
    put(0, 1, n, keep(rows:narrow(2, c0 + 1, n)))
  else
    local head = K - c0
    put(0, 1, head, keep(keep(rows:narrow(1, 1, 1)):narrow(2, c0 + 1, head)))
    if w > 2 then put(head, w - 2, K, keep(rows:narrow(1, 2, w - 2))) end
    put(n - c1 - 1, 1, c1 + 1, keep(keep(rows:narrow(1, w, 1)):narrow(2, 1, c1 + 1)))
  end
end

-- Any other layout: the file tensor is read whole (this parameter only),
-- the ops undone and this rank's range copied out.
local function read_whole(fd, info, e, a, n, dst, keep)
  local te = info.tensors[e.fname]
  local t = host_stage(keep, e.shape, te.dtype)
  pread_exact(fd, t:data_ptr(), te.nbytes, info.data_start + te.offsets[1], info, e.fname)
  for i = #e.ops, 1, -1 do
    local op = e.ops[i]
    if op[1] == "transpose" then
      t = keep(t:transpose(op[2], op[3]))
    else   -- rows cut off by the export come back as zeros
      local z = keep(fsdp.zeros(op[5], { dtype = file_dtype[te.dtype], tag = "other", device = "cpu" }))
      keep(z:narrow(op[2], op[3], op[4])):copy(t)
      t = z
    end
  end
  local flat = keep(keep(t:contiguous()):view(-1))
  dst:copy(keep(flat:narrow(1, a + 1, n)))
end

-- Fills dst (f32, n elements) with elements [a, a + n) of the parameter
-- that layout entry e maps from the file; its stagings are freed on return.
local function import_range(fd, info, e, a, n, dst)
  local ops = e.ops
  local read = read_whole
  if #ops == 0 or (#ops == 1 and ops[1][1] == "narrow" and ops[1][2] == 1 and ops[1][3] == 1) then
    read = read_same_order
  elseif #ops == 1 and ops[1][1] == "transpose" and #e.shape == 2 and
      ((ops[1][2] == 1 and ops[1][3] == 2) or (ops[1][2] == 2 and ops[1][3] == 1)) then
    read = read_transposed
  end
  local keep, close = scope()
  local ok, err = pcall(read, fd, info, e, a, n, dst, keep)
  close()
  if not ok then error(err, 0) end
end

--- fsdp.checkpoint.import(path, model, opts): initializes a model (sharded
-- or an nn module) from a safetensors file of full tensors (F32 or BF16),
-- as export writes it or as Hugging Face ships GPT-2. Collective. Each rank
-- reads only the byte ranges of its own slices (of a transposed tensor too:
-- one run of columns per file row) and writes them into its shard, one
-- parameter at a time: a load peaks at the shard plus one parameter's
-- staging, never a second copy of the shard. opts.hf: the file uses to_hf
-- names and layouts (default: as the file's metadata says; else true for
-- models with to_hf). opts.strict (true): tensors in the file that map to
-- nothing are an error (HF's attention-mask buffers and a tied
-- lm_head.weight are always skipped).
--
-- Everything that can be checked before a byte is written is checked on
-- every rank first (names, shapes, dtypes, that the data lies within the
-- file); a read that fails after that (the file shrank under us) is an
-- error on every rank saying that the model is partly imported.
function M.import(path, target, opts)
  local what = "fsdp.checkpoint.import"
  if type(path) ~= "string" then raise(what .. ": path must be a string") end
  opts = opts or {}
  local d = describe(target, what)
  local info, by_path = together(d.comm, function()
    local info = safetensors.read_header(path)
    local hf = opts.hf
    if hf == nil then
      if info.metadata.fsdp_layout then hf = info.metadata.fsdp_layout == "hf" else hf = d.model.to_hf ~= nil end
    end
    local layout = export_layout(d, hf)
    -- file names, with HF's "transformer." prefix accepted
    local fnames = {}
    for _, name in ipairs(info.names) do fnames[(name:gsub("^transformer%.", ""))] = name end
    local by_path, used = {}, {}
    for _, e in ipairs(layout) do
      local fname = fnames[e.name]
      if fname then
        local te = info.tensors[fname]
        local same = #te.shape == #e.shape
        for i = 1, #e.shape do same = same and te.shape[i] == e.shape[i] end
        if not same then
          error(fmt("%s: %s: tensor %q has shape %s, the model's '%s' needs %s there", what, path, fname,
            shape_str(te.shape), e.path, shape_str(e.shape)), 0)
        end
        if not file_elem[te.dtype] then
          error(fmt("%s: %s: tensor %q is %s (import reads F32 and BF16)", what, path, fname, te.dtype), 0)
        end
        e.fname = fname
        used[fname] = true
        by_path[e.path] = by_path[e.path] or e
      end
    end
    for _, p in ipairs(d.params) do
      if not by_path[p.path] then
        error(fmt("%s: %s has no tensor for parameter '%s'%s", what, path, p.path,
          hf and " (looked for its Hugging Face name)" or ""), 0)
      end
    end
    if opts.strict ~= false then
      for _, name in ipairs(info.names) do
        local n = name:gsub("^transformer%.", "")
        if not used[name] and n ~= "lm_head.weight" and not n:match("%.attn%.bias$")
            and not n:match("%.attn%.masked_bias$") then
          error(fmt("%s: %s: tensor %q matches no parameter of the model (pass strict = false to ignore it)", what,
            path, name), 0)
        end
      end
    end
    return info, by_path
  end)
  local okr, rerr = pcall(function()
    local okf, fd = pcall(fio.open, path, "r")
    if not okf then error(fmt("%s: %s: cannot open: %s", what, path, fd), 0) end
    local ok, err = pcall(function()
      if fd:size() ~= info.file_bytes then
        error(fmt("%s: %s: the file has %d bytes, its header was read from %d (it changed during the import)",
          what, path, fd:size(), info.file_bytes), 0)
      end
      local total, done = 0, 0
      for _, s in ipairs(d.segments) do total = total + 4 * s.count end
      local report = common.progress(opts, "import", total)
      fsdp.no_grad(function()
        for _, s in ipairs(d.segments) do
          import_range(fd, info, by_path[s.path], s.start, s.count, s.flat)
          done = done + 4 * s.count
          report(done)
        end
      end)
    end)
    fd:close()
    if not ok then error(err, 0) end
  end)
  local wrote = okr
  together(d.comm, function()
    if not okr then
      error(fmt("%s (rank %d; the model's parameters are partly imported)", tostring(rerr), d.rank), 0)
    end
  end)
  if d.sharded and wrote then
    -- gathered buffers (the root stays gathered between steps) hold old values
    for _, u in ipairs(d.sharded.units) do C.fsdp_unit_reshard(d.sharded.sched, u.index) end
  end
  return target
end

return M
