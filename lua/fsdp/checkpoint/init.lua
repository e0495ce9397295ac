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
-- A save writes into dir .. ".tmp" (marked by rank 0 with a token every
-- writer must find there: one filesystem for all); after every rank has
-- written, synced and read back its file, and rank 0 has found each of them
-- there with its size, rank 0 writes index.json and renames the directory
-- into place, so a run killed during a save leaves the previous checkpoint
-- intact (a kill between the renames over an existing step: dirs.recover). A
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
local dirs = require "fsdp.checkpoint.dirs"

local raise = require("fsdp.core").raise
local json = require "fsdp.json"
local fmt = string.format
local together, describe, is_uint = common.together, common.describe, common.is_uint

local M = {}

M.FORMAT = format.FORMAT
M.VERSION = format.VERSION

M.save = write.save
M.load = read.load
M.read_index = format.read_index
M.describe = format.describe
M.export = export.export
M.import = export.import

-- ---- checkpoint directories: latest, save_step, retention ----

--- fsdp.checkpoint.exists(dir) -> true when dir is a complete checkpoint
-- (its index.json is there: written last).
function M.exists(dir)
  if type(dir) ~= "string" then raise("fsdp.checkpoint.exists: dir must be a string") end
  return fio.is_file((dir:gsub("/+$", "")) .. "/index.json")
end

--- fsdp.checkpoint.verify(dir) -> index, or nil and the reason: the index
-- (checksum, structure) and every file it names there with its size (a
-- load also checks every byte it reads against its checksum).
function M.verify(dir)
  if type(dir) ~= "string" then raise("fsdp.checkpoint.verify: dir must be a string") end
  return dirs.verify((dir:gsub("/+$", "")))
end

--- fsdp.checkpoint.latest(root) -> dir, step of the newest checkpoint
-- (root/step_NNNNNNNN) that verifies, or nil; third, the newer ones that
-- do not: { {dir =, reason =} }.
function M.latest(root)
  if type(root) ~= "string" then raise("fsdp.checkpoint.latest: root must be a string") end
  local dir, step, _, skipped = dirs.newest((root:gsub("/+$", "")))
  return dir, step, skipped
end

--- fsdp.checkpoint.step_dir(root, step) -> root/step_00000010.
function M.step_dir(root, step)
  return dirs.step_dir((root:gsub("/+$", "")), step)
end

--- fsdp.checkpoint.save_step(root, step, state, {keep = K, run = line,
-- log = fn}) -> dir. Saves into root/step_NNNNNNNN (state.step defaults to
-- step). Before, a publish a kill interrupted is repaired and, with a run's
-- line (opts.run, as fsdp.checkpoint.manager keeps it; stored in the
-- index), the checkpoints of other lines move to root/abandoned/<id>/.
-- After, only the newest K checkpoints that verify (of the line) are kept
-- (all when keep is nil or 0). log gets the lines saying what moved.
function M.save_step(root, step, state, opts)
  if type(root) ~= "string" or root == "" then raise("fsdp.checkpoint.save_step: root must be a non-empty string") end
  if not is_uint(step) then raise("fsdp.checkpoint.save_step: step must be a non-negative integer") end
  local keep, line, log = opts and opts.keep, opts and opts.run, opts and opts.log
  if keep ~= nil and not is_uint(keep) then raise("fsdp.checkpoint.save_step: keep must be a non-negative integer") end
  root = root:gsub("/+$", "")
  local st = {}
  for k, v in pairs(state) do st[k] = v end
  if st.step == nil then st.step = step end
  if line then st.run = line end
  local dir = M.step_dir(root, step)
  local d = describe(state.model, "fsdp.checkpoint.save_step")
  together(d.comm, function()
    if d.rank ~= 0 then return end
    dirs.recover(root, log)
    if line then dirs.move_aside(root, line, log) end
  end)
  M.save(dir, st, opts)
  together(d.comm, function()
    if d.rank ~= 0 then return end
    dirs.recover(root)   -- the debris of earlier interrupted saves
    if keep and keep > 0 then dirs.retain(root, keep, line) end
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

-- A new run's id (only rank 0's is ever stored): time and random bytes.
local function new_run_id()
  local f = io.open("/dev/urandom", "rb")
  local bytes = f and f:read(6) or tostring(os.clock())
  if f then f:close() end
  return fmt("%s-%s", os.date("!%Y%m%dT%H%M%S"), fio.hash_string(bytes .. tostring(os.time())):sub(1, 8))
end

-- Rank 0's choice of the checkpoint to resume from, after repairing a
-- publish that a kill interrupted: { dir =, notes = { lines }, err = }.
local function choose_resume(from, explicit, what)
  local notes = {}
  local function note(...) notes[#notes + 1] = fmt(...) end
  local arg = explicit and ("--resume=" .. from) or "--resume"
  -- a checkpoint folder itself (its index, or shard files without one): that one or nothing
  if M.exists(from) or (fio.is_dir(from) and fio.is_file(from .. "/rank_00000.bin")) then
    local index, why = dirs.verify(from)
    if not index then return { err = fmt("%s: %s: %s is not a complete checkpoint: %s", what, arg, from, why) } end
    return { dir = from, notes = notes }
  end
  dirs.recover(from, note)
  local dir, _, _, skipped = dirs.newest(from)
  for _, sk in ipairs(skipped) do
    note("%s: skipping %s: %s", arg, sk.dir, sk.reason)
  end
  if dir and #skipped > 0 then note("%s: going on from %s, the newest checkpoint that verifies", arg, dir) end
  if not dir and explicit then
    return { err = fmt("%s: %s: no checkpoint there (none in it, nor under it%s)", what, arg,
      #skipped > 0 and fmt("; %d that do not verify", #skipped) or "") }
  end
  return { dir = dir, notes = notes }
end

--- fsdp.checkpoint.manager{ save_dir = DIR, save_every = N (0: never),
--   keep = K (0 or nil: all), resume = nil | true | PATH, what = "recipe",
--   log = fn } -> the checkpoints of one training run, named as a recipe's
-- options (--save-dir, --save-every, --keep, --resume) name them. Make it
-- before anything is built: it finds where to resume from, and a mistake
-- is a usage error (one line) before any work is done. Collective when
-- resume is given (rank 0 chooses).
--   resume == true: the newest checkpoint in save_dir that verifies (newer
--   ones that do not are named and skipped; a publish a kill interrupted is
--   repaired first); none yet is a fresh start.  resume == PATH: that
--   checkpoint, refused unless it verifies, or the newest under PATH as
--   above; none is a usage error.
-- The run saves on its own line (DESIGN.md, decision 16): its first save
-- moves checkpoints of other runs, or of the future a rolled-back run
-- abandoned, to save_dir/abandoned/<run id>/, and retention counts only
-- the line's checkpoints that verify.
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
  local dist = require "fsdp.distributed"
  local self = setmetatable({ save_dir = save_dir:gsub("/+$", ""), save_every = every, keep = keep, what = what,
    log = opts.log or dist.print0, id = new_run_id() }, Manager)
  self.line = { id = self.id, forked = json.array({}) }
  if every > 0 then
    -- a folder that cannot be written is found now, not after save_every steps
    local problem
    local ok, err = pcall(fio.mkdirs, self.save_dir)
    if not ok then
      problem = tostring(err):gsub("^.-:%d+: ", "")
    else
      problem = require("fsdp.options").outfile_problem(fmt("%s/.write-test-rank%d", self.save_dir, dist.rank()))
    end
    if problem then
      require("fsdp.options").fail("%s: --save-dir=%s cannot be written on rank %d (%s); checkpoints are due every "
        .. "%d steps", what, save_dir, dist.rank(), problem, every)
    end
  end
  if resume then
    self.resume_from = resume == true and save_dir or resume
    local from = self.resume_from:gsub("/+$", "")
    local pick
    if dist.rank() == 0 then
      local ok, p = pcall(choose_resume, from, resume ~= true, what)
      pick = ok and p or { err = fmt("%s: --resume: %s", what, tostring(p)) }
    end
    pick = dist.broadcast(pick)
    for _, line in ipairs(pick.notes or {}) do self.log("%s", line) end
    if pick.err then require("fsdp.options").fail("%s", pick.err) end
    self.dir = pick.dir
  end
  return self
end

--- m:load{ model = sharded, optim = opt, data = loader, val = loader,
--   schedule = {...}, extra = {...}, steps = N, config = {...} } -> the first step to
-- run: 1 on a fresh start, else the saved step + 1, with the model, the
-- optimizer, both loaders' positions and the dropout RNG as they were
-- saved. Collective. The parts are kept for maybe_save: schedule and extra
-- (plain tables) are saved with every checkpoint, the schedule with its
-- step. steps (the run's last step, optional): a checkpoint at or past it
-- is said to leave nothing to train (m.nothing_to_train is then true).
-- config (the run's resolved options, a plain table; options.plain) is
-- saved as extra.config, and a resume whose options differ from the
-- checkpoint's logs each that differs (resume and config aside, and the
-- names in the set config_ignore) and goes on.
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
  self.line = dirs.child_line(index, self.id)   -- this run goes on from that checkpoint's line
  self.log("resumed from %s (saved by %d rank(s)): step %d, next data window %d of epoch %d", self.dir,
    info.world_size, info.step, info.data.index, info.data.epoch)
  if info.residuals then self.log("%s", info.residuals) end
  -- the run's options against those the checkpoint was saved with (it goes on either way)
  local saved = info.extra and info.extra.config
  if type(parts.config) == "table" and type(saved) == "table" then
    local skip = { resume = true, config = true }
    for k in pairs(parts.config_ignore or {}) do skip[k] = true end
    local diff = require("fsdp.options").differences(parts.config, saved, skip)
    if #diff > 0 then
      self.log("--resume: %d setting%s differ%s from the checkpoint's: %s", #diff, #diff == 1 and "" or "s",
        #diff == 1 and "s" or "", table.concat(diff, ", "))
    end
  end
  if parts.steps and info.step >= parts.steps then
    self.nothing_to_train = true
    self.log("%s: the checkpoint is at step %d, the run ends at step %d: nothing to train", self.what, info.step,
      parts.steps)
  end
  return info.step + 1
end

--- m:maybe_save(step) -> the checkpoint's folder when save_every divides
-- step (save_dir/step_NNNNNNNN, keeping the newest keep of the run's line),
-- else nil. Collective: every rank calls it after every step.
function Manager:maybe_save(step)
  if self.save_every == 0 or step % self.save_every ~= 0 then return nil end
  local p = self.parts
  if not p then raise(self.what .. ": maybe_save before load (load gives the parts to save)") end
  if not self.id_agreed then   -- rank 0's id, everywhere (the ranks made their own)
    self.id = require("fsdp.distributed").broadcast(self.id)
    self.line.id, self.id_agreed = self.id, true
  end
  local dir = M.save_step(self.save_dir, step, {
    model = p.model, optim = p.optim, step = step, data = p.data:state(), rng = require("fsdp.nn").rng_state(),
    schedule = p.schedule and with(p.schedule, "step", step),
    extra = with(with(p.extra, "val", p.val and p.val:state()), "config", p.config),
  }, { keep = self.keep > 0 and self.keep or nil, run = self.line, log = self.log })
  self.last_saved = dir
  self.log("step %5d | saved %s", step, dir)
  return dir
end

return M
