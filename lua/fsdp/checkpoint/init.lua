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
--   local run = ck.manager{ save_dir = "ckpt", save_every = 50, keep = 3, resume = true }   -- a training run's
--   local first = run:load{ model = sharded, optim = opt, data = train, val = val }     -- 1, or on from the newest
--   for step = first, steps do ... run:maybe_save(step) end
--   ck.import("gpt2.safetensors", sharded)
--
-- save, load, export and import take opts.progress: a function(op, done,
-- total) called as this rank's bytes move (op "save", "load", "export",
-- "import"; done reaches total), e.g. to draw a progress bar.
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
--                       per file its size and checksum; last, the
--                       index's own checksum ("index_checksum").
-- Checksums ("xxh64": XXH64, the 64-bit xxHash, from engine/io), computed
-- as the bytes are written: of each blob (one slice of one tensor, over its
-- padded extent); a file's checksum is the XXH64 of its blobs' checksums
-- and its size; each parameter entry has one of its own, and the index's
-- checksum covers every byte of index.json before its last member. A load
-- checks the index's checksum, that the ranges of every tensor tile it
-- exactly and that the blobs of every file tile the file, before it reads
-- anything else; then it reads every blob it needs whole and checks it
-- against its checksum. An edit of the index or of a shard file is an error
-- naming the file and the parameter.
--
-- A save writes into dir .. ".tmp"; after every rank has written and synced
-- its file, rank 0 writes index.json and renames the directory into place,
-- so a run killed during a save leaves the previous checkpoint intact. A
-- load reads and verifies everything into temporary tensors on every rank,
-- agrees across ranks that all went well, and only then touches the model
-- and the optimizer: a bad checkpoint raises the same error on every rank
-- and leaves memory as it was.
--
-- The parts: common (what this rank holds, agreement across ranks,
-- progress), format (index schema and checksums), write (save), read
-- (load, resharding), export (safetensors with Hugging Face names); this
-- file is the user API (fsdp.save, fsdp.load, fsdp.latest, fsdp.export, ...)
-- and the policy of checkpoint directories (step folders, retention).
local fsdp = require "fsdp"
local fio = require "fsdp.io"
local common = require "fsdp.checkpoint.common"
local format = require "fsdp.checkpoint.format"
local write = require "fsdp.checkpoint.write"
local read = require "fsdp.checkpoint.read"
local export = require "fsdp.checkpoint.export"

local raise = require("fsdp.core").raise
local json = require "fsdp.json"
local fmt, sort = string.format, table.sort
local together, describe, is_uint = common.together, common.describe, common.is_uint
local remove_tree = write.remove_tree

local M = {}

M.FORMAT = format.FORMAT
M.VERSION = format.VERSION

M.save = write.save
M.load = read.load
M.read_index = format.read_index
M.describe = format.describe
M.export = export.export
M.import = export.import

-- The names in root, or none when root is not a directory.
local function list_dir(path)
  if not fio.is_dir(path) then return {} end
  return fio.list_dir(path)
end

-- ---- checkpoint directories: latest, save_step, retention ----

local function step_dirs(root)
  local list = {}
  for _, name in ipairs(list_dir(root)) do
    local n = name:match("^step_(%d+)$")
    if n and fio.is_file(root .. "/" .. name .. "/index.json") then
      list[#list + 1] = { step = tonumber(n), dir = root .. "/" .. name }
    end
  end
  sort(list, function(a, b) return a.step < b.step end)
  return list
end

--- fsdp.checkpoint.exists(dir) -> true when dir is a complete checkpoint
-- (its index.json is there: written last).
function M.exists(dir)
  if type(dir) ~= "string" then raise("fsdp.checkpoint.exists: dir must be a string") end
  return fio.is_file((dir:gsub("/+$", "")) .. "/index.json")
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

-- ---- a training run's checkpoints: resume, then save on a schedule ----

local Manager = {}
Manager.__index = Manager

-- A copy of table t (nil: none) with t[k] = v.
local function with(t, k, v)
  local c = {}
  for key, x in pairs(t or {}) do c[key] = x end
  c[k] = v
  return c
end

--- fsdp.checkpoint.manager{ save_dir = DIR, save_every = N (0: never),
--   keep = K (0 or nil: all), resume = nil | true | PATH, what = "recipe",
--   log = fn } -> the checkpoints of one training run, named as a recipe's
-- options (--save-dir, --save-every, --keep, --resume) name them. Make it
-- before anything is built: it finds where to resume from, and a mistake
-- is a usage error (one line) before any work is done.
--   resume == true: the newest complete checkpoint in save_dir; none yet is
--   a fresh start.  resume == PATH: that checkpoint, or the newest under
--   PATH; none is a usage error.
-- m.dir is the checkpoint to resume from (nil: a fresh start). log (default
-- fsdp.distributed.print0) gets the lines that say what happened.
function M.manager(opts)
  if type(opts) ~= "table" then raise("fsdp.checkpoint.manager: expected an options table") end
  local what = opts.what or "fsdp.checkpoint.manager"
  local save_dir, every, keep, resume = opts.save_dir, opts.save_every or 0, opts.keep or 0, opts.resume
  if type(save_dir) ~= "string" or save_dir == "" then raise(what .. ": save_dir must be a non-empty string") end
  if not is_uint(every) then raise(what .. ": save_every must be a non-negative integer, got " .. tostring(every)) end
  if not is_uint(keep) then raise(what .. ": keep must be a non-negative integer, got " .. tostring(keep)) end
  if resume ~= nil and resume ~= false and resume ~= true and type(resume) ~= "string" then
    raise(what .. ": resume must be nil, true or a path, got " .. type(resume))
  end
  local self = setmetatable({ save_dir = save_dir, save_every = every, keep = keep, what = what,
    log = opts.log or require("fsdp.distributed").print0 }, Manager)
  if resume then
    self.resume_from = resume == true and save_dir or resume
    self.dir = M.exists(self.resume_from) and self.resume_from or M.latest(self.resume_from)
    if not self.dir and resume ~= true then
      require("fsdp.options").fail("%s: --resume=%s: no checkpoint there (none in it, nor under it)", what, resume)
    end
  end
  return self
end

--- m:load{ model = sharded, optim = opt, data = loader, val = loader,
--   schedule = {...}, extra = {...} } -> the first step to run: 1 on a
-- fresh start, else the saved step + 1, with the model, the optimizer, both
-- loaders' positions and the dropout RNG as they were saved. Collective.
-- The parts are kept for maybe_save: schedule and extra (plain tables)
-- are saved with every checkpoint, the schedule with its step.
function Manager:load(parts)
  if type(parts) ~= "table" or parts.model == nil or parts.data == nil then
    raise(self.what .. ": load needs { model =, data = (the training loader), optim =, val = }")
  end
  self.parts = parts
  local nn = require "fsdp.nn"
  if not self.dir then
    if self.resume_from then self.log("--resume: no checkpoint under %s yet; starting at step 1", self.resume_from) end
    return 1
  end
  -- A checkpoint fsdp.checkpoint.save wrote without the loader's position
  -- (or a step) cannot be resumed where it stopped: starting the data over
  -- would quietly train on other batches than the uninterrupted run.
  local index = M.read_index(self.dir)
  local function given(x) return x ~= nil and x ~= json.null end
  if not given(index.data) or not given(index.step) then
    raise(fmt("%s: cannot resume from %s: the checkpoint has no %s (saved without %s), so the run cannot go on "
      .. "where it stopped; load its weights with fsdp.checkpoint.load and start a new run instead", self.what,
      self.dir, given(index.step) and "data-loader position" or "step",
      given(index.step) and "data = loader:state()" or "step ="))
  end
  local info = M.load(self.dir, { model = parts.model, optim = parts.optim })
  parts.data:set_state(info.data)
  if parts.val and info.extra and info.extra.val then parts.val:set_state(info.extra.val) end
  if info.rng then nn.set_rng_state(info.rng) end
  self.last_saved = self.dir
  self.log("resumed from %s (saved by %d rank(s)): step %d, next data window %d of epoch %d", self.dir,
    info.world_size, info.step, info.data.index, info.data.epoch)
  if info.residuals then self.log("%s", info.residuals) end
  return info.step + 1
end

--- m:maybe_save(step) -> the checkpoint's folder when save_every divides
-- step (save_dir/step_NNNNNNNN, keeping the newest keep), else nil.
-- Collective: every rank calls it after every step.
function Manager:maybe_save(step)
  if self.save_every == 0 or step % self.save_every ~= 0 then return nil end
  local p = self.parts
  if not p then raise(self.what .. ": maybe_save before load (load gives the parts to save)") end
  local dir = M.save_step(self.save_dir, step, {
    model = p.model, optim = p.optim, step = step, data = p.data:state(), rng = require("fsdp.nn").rng_state(),
    schedule = p.schedule and with(p.schedule, "step", step),
    extra = with(p.extra, "val", p.val and p.val:state()),
  }, { keep = self.keep > 0 and self.keep or nil })
  self.last_saved = dir
  self.log("step %5d | saved %s", step, dir)
  return dir
end

return M
