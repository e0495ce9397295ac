-- fsdp.checkpoint: sharded checkpoints that load on any number of ranks,
-- crash-safe checkpoint directories with retention, and a full safetensors
-- export / import that never holds the whole model on one rank.
--
--   local ck = require "fsdp.checkpoint"
--   ck.save("ckpt/step_00000100", { model = sharded, optim = opt, step = 100,
--           data = loader:state(), rng = {...}, schedule = {...}, extra = {...} })
--   local info = ck.load("ckpt/step_00000100", { model = sharded, optim = opt })
--   ck.save_step("ckpt", 100, state, { keep = 3 })   -- ckpt/step_00000100, keeps the last 3
--   local dir = ck.latest("ckpt")                     -- newest complete one, or nil
--   ck.export("gpt2.safetensors", sharded, { hf = true })
--   ck.import("gpt2.safetensors", sharded)
--
-- Layout of a checkpoint directory (DESIGN.md, decision 7):
--   rank_00000.bin ...  one file per shard rank of the first replica group,
--                       written in parallel: this rank's slice of every
--                       parameter (f32, unit by unit), then its slices of
--                       each optimizer state tensor; every blob starts at a
--                       multiple of 64 bytes.
--   index.json          written by rank 0 last: format version, world size,
--                       strategy; for every parameter its global shape and
--                       which byte ranges of which file hold which element
--                       ranges of it; the same for each optimizer state
--                       tensor (in parameter space, so a load can reshard);
--                       optimizer type, hyperparameters, step counts; the
--                       step, schedule, data-loader and RNG state, extra;
--                       per file its size and checksums.
-- Checksums ("xxh64": XXH64, the 64-bit xxHash, from engine/io), computed
-- as the bytes are written: of each chunk of chunk_bytes (1 MiB) of a file,
-- of the whole file (as xxhsum prints it), and of each blob (one slice of
-- one tensor, over its padded extent). A load that reads part of a file
-- verifies every chunk it touches, so a flipped byte is caught without
-- reading whole files; the blob hashes then name the damaged parameter.
--
-- A save writes into dir .. ".tmp"; after every rank has written and synced
-- its file, rank 0 writes index.json and renames the directory into place,
-- so a run killed during a save leaves the previous checkpoint intact. A
-- load reads and verifies everything into temporary tensors on every rank,
-- agrees across ranks that all went well, and only then touches the model
-- and the optimizer: a bad checkpoint raises the same error on every rank
-- and leaves memory as it was.
local ffi = require "ffi"
local fsdp = require "fsdp"
local json = require "fsdp.json"
local safetensors = require "fsdp.safetensors"
local fio = require "fsdp.io"

local C = fsdp.C
local core = fsdp.core
local raise = core.raise
local fmt, concat, sort = string.format, table.concat, table.sort
local floor, min, max = math.floor, math.min, math.max

local M = {}

M.FORMAT = "fsdp-lua-checkpoint"
M.VERSION = 2
M.CHECKSUM = "xxh64"
M.chunk_bytes = 1048576          -- checksum granularity (a multiple of 64)
M.stage_bytes = 64 * 1048576     -- read-staging buffer of a load
local ALIGN = 64                 -- every blob of a shard file starts at a multiple of this

-- ---- files (engine/io through fsdp.io) ----

local u8p = ffi.typeof("const uint8_t *")

-- Reads exactly n bytes at off of an open fsdp.io file; returns the count
-- read (short only at the end of the file).
local function pread_all(f, ptr, n, off)
  return f:pread(ptr, n, off)
end

local exists = fio.is_file
local is_dir = fio.is_dir
local parent_of = fio.parent

local function remove_tree(path)
  if path == "" or path == "/" then error("refusing to remove '" .. path .. "'", 0) end
  fio.remove_tree(path)
end

-- The names in root, or none when root is not a directory.
local function list_dir(path)
  if not is_dir(path) then return {} end
  return fio.list_dir(path)
end

-- A staging buffer for reads (host memory outside the engine's allocator).
local function new_buffer(n) return ffi.new("uint8_t[?]", n) end

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
-- ---- communication: agreement, strings ----

local MAX_OP = 2
local dbl = ffi.new("double[1]")
local int2 = ffi.new("int[2]")
local comm_box = ffi.new("fsdp_comm *[1]")

local function comm_info(c)
  if C.fsdp_comm_info(c, int2, int2 + 1) ~= 0 then raise() end
  return int2[0], int2[1]
end

local function allreduce1(comm, v, op)
  dbl[0] = v
  if C.fsdp_all_reduce_doubles(comm, dbl, 1, op) ~= 0 then raise() end
  return dbl[0]
end

local function world_comm()
  if C.fsdp_comm_world(comm_box) ~= 0 then raise() end
  return ffi.gc(comm_box[0], C.fsdp_comm_free)
end

-- root's string s, on every rank of comm.
local function broadcast_string(comm, root, s)
  local rank = comm_info(comm)
  local n = allreduce1(comm, rank == root and #s or 0, MAX_OP)
  local t = fsdp.zeros({ floor((n + 3) / 4) + 1 }, { dtype = "i32", device = "cpu" })
  if rank == root then ffi.copy(t:data_ptr(), s, #s) end
  if C.fsdp_broadcast(nil, comm, t, root, "checkpoint.message") ~= 0 then raise() end
  return ffi.string(t:data_ptr(), n)
end

-- Every rank's string s, on rank 0 (a list by rank); nil elsewhere.
local function gather_strings(comm, s)
  local rank, size = comm_info(comm)
  if size == 1 then return { s } end
  local n = allreduce1(comm, #s, MAX_OP)
  local words = floor((n + 3) / 4) + 1
  local src = fsdp.zeros({ words }, { dtype = "i32", device = "cpu" })
  local p = ffi.cast("int32_t *", src:data_ptr())
  p[0] = #s
  ffi.copy(p + 1, s, #s)
  local dst = fsdp.empty({ words * size }, { dtype = "i32", device = "cpu" })
  if C.fsdp_all_gather(nil, comm, dst, src, "checkpoint.meta") ~= 0 then raise() end
  if rank ~= 0 then return nil end
  local q = ffi.cast("int32_t *", dst:data_ptr())
  local list = {}
  for r = 0, size - 1 do
    local base = q + r * words
    list[r + 1] = ffi.string(base + 1, base[0])
  end
  return list
end

-- Collective: if any rank failed (ok false), every rank raises the error of
-- the lowest failing rank, so all ranks leave the call the same way.
local function agree(comm, ok, err)
  if comm == nil then
    if not ok then raise(tostring(err)) end
    return
  end
  local rank, size = comm_info(comm)
  local worst = allreduce1(comm, ok and 0 or (size - rank), MAX_OP)
  if worst == 0 then return end
  local root = size - worst
  raise(broadcast_string(comm, root, ok and "" or tostring(err)))
end

-- Runs fn in protected mode, then agrees across ranks on the outcome.
local function together(comm, fn, ...)
  local res = { pcall(fn, ...) }
  agree(comm, res[1], res[2])
  return unpack(res, 2)
end

-- ---- what is saved: a description of a model on this rank ----

local function numel_of(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

local function shape_str(s) return "(" .. concat(s, ", ") .. ")" end

local function is_sharded(x)
  return type(x) == "table" and x.units ~= nil and x.sched ~= nil and x.segments ~= nil
end

local function is_module(x)
  return type(x) == "table" and x._param_names ~= nil and type(x.named_parameters) == "function"
end

local function check_f32(t, what)
  if t:dtype() ~= "f32" or not t:is_contiguous() then
    error(fmt("%s: %s is %s; checkpoints hold contiguous f32 tensors", what, "tensor", t:describe()), 0)
  end
end

-- t's values in host memory, for files: t itself on the CPU, else a copy
-- (a GPU tensor is staged one shard slice at a time).
local function on_host(t)
  if t:device() == "cpu" then return t end
  return t:cpu()
end

-- { kind, model, comm, rank, params = { {path, shape, numel} } (model order),
--   segments = { {path, start, count, flat, key} }, writer, file_id, nfiles,
--   strategy, group_size, units }
local function describe(target, what)
  local d = { params = {}, segments = {} }
  if is_sharded(target) then
    d.kind, d.sharded, d.model = "sharded", target, target.model
    d.comm = target.world
    d.rank = comm_info(target.world)
    d.world = select(2, comm_info(target.world))
    local srank, ssize = comm_info(target.shard_comm)
    d.file_id, d.nfiles = srank, ssize
    -- replicas hold equal shards: only the first replica group writes
    d.writer = target.replica_comm == nil or (comm_info(target.replica_comm)) == 0
    d.strategy = target.strategy
    d.group_size = target.strategy == "hybrid_shard" and ssize or nil
    local k = 0
    for _, u in ipairs(target.units) do
      local lo, hi = u.shard_offset, u.shard_offset + u.shard_numel
      for i, p in ipairs(u.params) do
        local off = u.offsets[i]
        local a, b = max(lo, off), min(hi, off + p.numel)
        if a < b then
          k = k + 1
          local s = target.segments[k]
          if not s or s.path ~= p.path then
            error(what .. ": the sharded model's segments do not follow its units (at " .. p.path .. ")", 0)
          end
          d.segments[#d.segments + 1] = { path = p.path, start = a - off, count = b - a, flat = s.tensor,
            key = s.tensor }
        end
      end
    end
  elseif is_module(target) then
    if rawget(target, "forward") ~= nil then
      -- fsdp.shard wraps the root's forward; its fields are views of gathered buffers
      error(what .. ": this module has been sharded; pass the object fsdp.shard returned", 0)
    end
    d.kind, d.model = "module", target
    d.comm = world_comm()
    d.rank, d.world = comm_info(d.comm)
    d.writer, d.file_id, d.nfiles = d.rank == 0, 0, 1
    d.strategy = "none"
    for _, p in ipairs(target:named_parameters()) do
      local t = p.tensor
      if not t then
        error(fmt("%s: parameter '%s' is not materialized (call model:materialize{} or pass the sharded model)",
          what, p.path), 0)
      end
      if t:dtype() ~= "f32" or not t:is_contiguous() then
        error(fmt("%s: parameter '%s' is %s; checkpoints hold contiguous f32 tensors", what, p.path,
          t:describe()), 0)
      end
      local flat = fsdp.no_grad(function() return t:detach():view(-1) end)
      d.segments[#d.segments + 1] = { path = p.path, start = 0, count = numel_of(p.shape), flat = flat, key = t }
    end
  else
    error(what .. ": model must be a sharded model (fsdp.shard) or an nn module, got " .. type(target), 0)
  end
  for _, p in ipairs(d.model:named_parameters()) do
    d.params[#d.params + 1] = { path = p.path, shape = p.shape, numel = numel_of(p.shape) }
  end
  return d
end

-- Optimizer type and the names of its per-parameter state tensors.
local function optim_kind(opt, what)
  local g = type(opt) == "table" and type(opt.groups) == "table" and opt.groups[1]
  if not g or type(opt.state) ~= "table" then
    error(what .. ": optim must be an fsdp.optim optimizer (AdamW or SGD)", 0)
  end
  if g.beta1 ~= nil then return "AdamW", { "exp_avg", "exp_avg_sq" } end
  if g.momentum ~= nil then return "SGD", { "buf" } end
  error(what .. ": unknown optimizer (expected AdamW or SGD)", 0)
end

local function group_hparams(g)
  local h = {}
  for k, v in pairs(g) do
    local tv = type(v)
    if k ~= "params" and (tv == "number" or tv == "boolean" or tv == "string") then h[k] = v end
  end
  return h
end

-- ---- save ----

-- A shard file being written: blobs at multiples of ALIGN, hashed as written.
local function new_out(path, chunk)
  local ok, f = pcall(fio.open, path, "w")
  if not ok then error(f, 0) end
  return { f = f, path = path, pos = 0, hasher = new_hasher(chunk), blob = fio.hasher(),
    tail = ffi.new("uint8_t[?]", ALIGN) }
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
  o.blob:reset()
  if body > 0 then
    o.f:append(p, body)
    o.hasher:update(p, body)
    o.blob:update(p, body)
  end
  local rest = n - body
  if rest > 0 then
    ffi.fill(o.tail, ALIGN, 0)
    ffi.copy(o.tail, p + body, rest)
    o.f:append(o.tail, ALIGN)
    o.hasher:update(o.tail, ALIGN)
    o.blob:update(o.tail, ALIGN)
  end
  o.pos = off + body + (rest > 0 and ALIGN or 0)
  return off, o.blob:hex()
end

local function finish_out(o)
  local ok, err = pcall(function() o.f:sync() end)
  local f = o.f
  o.f = nil
  f:close()
  if not ok then error(err, 0) end
  local sum, chunks = o.hasher:finish()
  return sum, chunks
end

-- This rank's file: parameter slices, then optimizer state slices. Returns
-- the record for index.json.
local function write_shard(d, opt, tmp, chunk)
  local name = fmt("rank_%05d.bin", d.file_id)
  local o = new_out(tmp .. "/" .. name, chunk)
  local rec = { file = name, params = {}, optim = {} }
  local ok, err = pcall(function()
    for _, s in ipairs(d.segments) do
      local h = on_host(s.flat)
      local off, sum = put(o, h:data_ptr(), 4 * s.count)
      if h ~= s.flat then h:free() end   -- (also keeps the copy alive until put is done)
      rec.params[#rec.params + 1] = { s.path, s.start, s.count, off, sum }
    end
    if opt then
      local _, names = optim_kind(opt, "fsdp.checkpoint.save")
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
              local off, sum = put(o, h:data_ptr(), 4 * s.count)
              if h ~= t then h:free() end
              rec.optim[#rec.optim + 1] = { s.path, nm, s.start, s.count, off, st.step or opt.step_count or 0, sum }
            end
          end
        end
      end
    end
    rec.checksum, rec.chunks = finish_out(o)
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

-- Rank 0: the index from every writer's record.
local function build_index(d, state, opt, texts, chunk)
  local records = {}
  for i, text in ipairs(texts) do records[i] = json.decode(text) end
  local index = {
    format = M.FORMAT, version = M.VERSION,
    world_size = d.world, num_files = d.nfiles, strategy = d.strategy, group_size = d.group_size,
    model = { type = d.model.__name, num_params = #d.params },
    step = state.step, schedule = state.schedule, data = state.data, rng = state.rng, extra = state.extra,
    checksum = { algorithm = M.CHECKSUM, chunk_bytes = chunk },
    files = json.array({}), params = json.array({}),
  }
  local pranges, oranges, osteps = {}, {}, {}
  local total = 0
  for _, rec in ipairs(records) do
    if rec.file then
      index.files[#index.files + 1] = { name = rec.file, bytes = rec.bytes, checksum = rec.checksum,
        chunks = json.array(rec.chunks) }
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

local function write_text(path, text)
  fio.write_atomic(path, text)
end

-- Rank 0, after every rank wrote and synced its file: the index, then the
-- directory into place (an older one of the same name goes aside first).
local function publish(dir, tmp, index, what)
  write_text(tmp .. "/index.json", json.encode(index, { indent = " " }) .. "\n")
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

local function check_state(state, what)
  if type(state) ~= "table" then error(what .. ": expected a state table {model =, optim =, step =, ...}", 0) end
  if state.model == nil then error(what .. ": state.model is required", 0) end
end

--- fsdp.checkpoint.save(dir, state, opts) -> dir. Collective: every rank
-- calls it. state: model (sharded or nn module, required), optim, step,
-- schedule, data, rng, extra (the last five: JSON-able values, stored in
-- index.json as rank 0 has them). opts.chunk_bytes: checksum chunk size.
function M.save(dir, state, opts)
  local what = "fsdp.checkpoint.save"
  if type(dir) ~= "string" or dir == "" then raise(what .. ": dir must be a non-empty string") end
  dir = dir:gsub("/+$", "")
  check_state(state, what)
  local chunk = opts and opts.chunk_bytes or M.chunk_bytes
  if chunk % ALIGN ~= 0 or chunk <= 0 then raise(fmt("%s: chunk_bytes %s is not a positive multiple of %d", what,
      tostring(chunk), ALIGN)) end
  local d = describe(state.model, what)
  local comm, rank = d.comm, d.rank
  local opt = state.optim
  local tmp = dir .. ".tmp"
  -- fail early and alike on every rank when the state cannot be stored
  together(comm, function()
    if opt then optim_kind(opt, what) end
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
      return write_shard(d, opt, tmp, chunk)
    end)
    local records = gather_strings(comm, json.encode(rec))
    together(comm, function()
      if rank == 0 then publish(dir, tmp, build_index(d, state, opt, records, chunk), what) end
    end)
  end)
  if not ok then
    if rank == 0 then remove_tree(tmp) end   -- every rank failed alike: nothing writes there now
    error(err, 0)
  end
  return dir
end

-- ---- reading an index ----

local function is_uint(v) return type(v) == "number" and v >= 0 and v == floor(v) and v < 2 ^ 53 end

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

local function run_reads(dir, index, reads)
  local chunk = index.checksum.chunk_bytes
  local stage_bytes = max(chunk, floor(M.stage_bytes / chunk) * chunk)
  local names = {}
  for name in pairs(reads) do names[#names + 1] = name end
  sort(names)
  if #names == 0 then return end
  with_stage(stage_bytes, function(stage)
    for _, name in ipairs(names) do
      read_file(dir, index.file_map[name], reads[name], chunk, stage, stage_bytes)
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
  run_reads(dir, index, reads)
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
      local idx = M.read_index(dir)
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

-- ---- checkpoint directories: latest, save_step, retention ----

local function step_dirs(root)
  local list = {}
  for _, name in ipairs(list_dir(root)) do
    local n = name:match("^step_(%d+)$")
    if n and exists(root .. "/" .. name .. "/index.json") then
      list[#list + 1] = { step = tonumber(n), dir = root .. "/" .. name }
    end
  end
  sort(list, function(a, b) return a.step < b.step end)
  return list
end

--- fsdp.checkpoint.latest(root) -> dir, step of the newest complete
-- checkpoint (root/step_NNNNNNNN with an index.json), or nil.
function M.latest(root)
  if type(root) ~= "string" then raise("fsdp.checkpoint.latest: root must be a string") end
  root = root:gsub("/+$", "")
  local list = step_dirs(root)
  local last = list[#list]
  if last then return last.dir, last.step end
  return nil
end

--- fsdp.checkpoint.step_dir(root, step) -> root/step_00000010.
function M.step_dir(root, step)
  return fmt("%s/step_%08d", (root:gsub("/+$", "")), step)
end

--- fsdp.checkpoint.save_step(root, step, state, {keep = K}) -> dir. Saves
-- into root/step_NNNNNNNN (state.step defaults to step), then keeps only
-- the newest K complete checkpoints (all when keep is nil or 0) and removes
-- leftovers of interrupted saves.
function M.save_step(root, step, state, opts)
  if type(root) ~= "string" or root == "" then raise("fsdp.checkpoint.save_step: root must be a non-empty string") end
  if not is_uint(step) then raise("fsdp.checkpoint.save_step: step must be a non-negative integer") end
  local keep = opts and opts.keep
  if keep ~= nil and not is_uint(keep) then raise("fsdp.checkpoint.save_step: keep must be a non-negative integer") end
  root = root:gsub("/+$", "")
  local st = {}
  for k, v in pairs(state) do st[k] = v end
  if st.step == nil then st.step = step end
  local dir = M.step_dir(root, step)
  M.save(dir, st, opts)
  local d = describe(state.model, "fsdp.checkpoint.save_step")
  together(d.comm, function()
    if d.rank ~= 0 then return end
    for _, name in ipairs(list_dir(root)) do
      if name:match("^step_%d+%.tmp$") or name:match("^step_%d+%.old$") then remove_tree(root .. "/" .. name) end
    end
    if keep and keep > 0 then
      local list = step_dirs(root)
      for i = 1, #list - keep do remove_tree(list[i].dir) end
    end
  end)
  return dir
end

-- ---- full export / import (safetensors) ----

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
  local function emit(p, t)
    if failure then return end
    local ok, err = pcall(function()
      for _, e in ipairs(by_path[p.path] or {}) do
        local v = on_host(fsdp.no_grad(function() return apply_ops(t:view(p.shape), e.ops) end))
        fd:pwrite(v:data_ptr(), 4 * v:numel(), data_start + e.offset)
        v:free()   -- (a view or a copy: only this reference goes; keeps it alive until the write is done)
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

-- Inverse of a to_hf layout for element range [a, a + n) of a parameter:
-- fills dst (f32 tensor of n elements) from the file.
local function import_range(fd, info, e, a, n, dst, cache)
  local te = info.tensors[e.fname]
  local base = info.data_start + te.offsets[1]
  local ops = e.ops
  if #ops == 0 or (#ops == 1 and ops[1][1] == "narrow" and ops[1][2] == 1 and ops[1][3] == 1) then
    -- the same element order (possibly fewer rows): read the range itself
    local have = numel_of(e.shape)
    local m = max(0, min(n, have - a))
    if m > 0 then
      local got = pread_all(fd, dst:data_ptr(), 4 * m, base + 4 * a, info.path)
      if got ~= 4 * m then error(fmt("%s: truncated data for tensor %q", info.path, e.fname), 0) end
    end
    if m < n then dst:narrow(1, m + 1, n - m):fill(0) end
    return
  end
  -- another order (a transpose): read the whole tensor once, undo the ops
  local full = cache[e.fname]
  if not full then
    local t = fsdp.empty(e.shape, { dtype = "f32", device = "cpu" })
    local nb = 4 * numel_of(e.shape)
    local got = pread_all(fd, t:data_ptr(), nb, base, info.path)
    if got ~= nb then error(fmt("%s: truncated data for tensor %q", info.path, e.fname), 0) end
    for i = #ops, 1, -1 do
      local op = ops[i]
      if op[1] == "transpose" then
        t = t:transpose(op[2], op[3])
      else   -- rows cut off by the export come back as zeros
        local z = fsdp.zeros(op[5], { dtype = "f32", device = "cpu" })
        z:narrow(op[2], op[3], op[4]):copy(t)
        t = z
      end
    end
    full = t:contiguous():view(-1)
    cache[e.fname] = full
  end
  dst:copy(full:narrow(1, a + 1, n))
end

--- fsdp.checkpoint.import(path, model, opts): initializes a model (sharded
-- or an nn module) from a safetensors file of full tensors, as export
-- writes it or as Hugging Face ships GPT-2. Collective. Each rank reads only
-- its slices (a transposed tensor is read whole, one at a time). opts.hf:
-- the file uses to_hf names and layouts (default: as the file's metadata
-- says; else true for models with to_hf). opts.strict (true): tensors in the
-- file that map to nothing are an error (HF's attention-mask buffers and a
-- tied lm_head.weight are always skipped).
function M.import(path, target, opts)
  local what = "fsdp.checkpoint.import"
  if type(path) ~= "string" then raise(what .. ": path must be a string") end
  opts = opts or {}
  local d = describe(target, what)
  local vals = together(d.comm, function()
    local st = safetensors
    local info = st.read_header(path)
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
        if te.dtype ~= "F32" then
          error(fmt("%s: %s: tensor %q is %s (import reads F32)", what, path, fname, te.dtype), 0)
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
    local okf, fd = pcall(fio.open, path, "r")
    if not okf then error(fmt("%s: %s: cannot open: %s", what, path, fd), 0) end
    local out, cache = {}, {}
    local ok, rerr = pcall(function()
      for i, s in ipairs(d.segments) do
        local t = fsdp.empty({ s.count }, { dtype = "f32", tag = "other", device = "cpu" })
        fsdp.no_grad(function() import_range(fd, info, by_path[s.path], s.start, s.count, t, cache) end)
        out[i] = t
      end
    end)
    fd:close()
    if not ok then error(rerr, 0) end
    return out
  end)
  commit(d, nil, vals, nil, nil, nil)
  return target
end

-- ---- inspection ----

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
