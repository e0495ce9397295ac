-- The checkpoints of a folder follow their run's line (fsdp.checkpoint.manager):
-- a run rolled back to an older checkpoint moves the abandoned future aside
-- and keeps its own saves through retention; a plain resume goes on from the
-- newest run; the newest checkpoint that does not verify (truncated, a rank's
-- file missing, an empty index) is named and skipped, an explicit one is
-- refused; a publish interrupted between its renames is repaired; a resume
-- at or past the last step says there is nothing to train.
--   mpirun -np 2 fsdp-lua tests/distributed/test_ckpt_lineage.lua --dir=build/ckpt_test_lineage
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local ck = require "fsdp.checkpoint"
local options = require "fsdp.options"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local rank = fsdp.rank()
local root = dir .. "/ckpt"

local model, sh, opt = common.sharded { policy = "block" }
local loader = common.loader(5)
if rank == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
common.barrier(sh)

local function step_of(n) return ck.step_dir(root, n) end
local function on_rank0(fn)
  if rank == 0 then fn() end
  common.barrier(sh)
end
local function sh_ok(cmd) on_rank0(function() assert(os.execute(cmd) == 0, cmd) end) end
local function run_id(path) return ck.read_index(path).run.id end

-- a run: its manager and the lines it logged
local function manager(resume, keep)
  local lines = {}
  local m = ck.manager { save_dir = root, save_every = 1, keep = keep or 0, resume = resume, what = "test",
    log = function(...) lines[#lines + 1] = string.format(...) end }
  m.lines = lines
  return m
end
local function logged(m, text)
  for _, l in ipairs(m.lines) do if l:find(text, 1, true) then return l end end
  return nil
end
local function train(m, from, to)
  for s = from, to do
    common.step(model, sh, opt, loader)
    m:maybe_save(s)
  end
end
local function parts(steps) return { model = sh, optim = opt, data = loader, steps = steps } end

-- run A: steps 1-6, keeping 4
local a = manager(nil, 4)
t.eq(a:load(parts()), 1, "a fresh start")
train(a, 1, 6)
t.eq(ck.latest(root), step_of(6), "run A's newest")

-- run B rolls back to A's step 3 and saves steps 4-7, keeping 4
local b = manager(step_of(3), 4)
t.eq(b:load(parts()), 4, "run B goes on from step 3")
train(b, 4, 4)
local aside = root .. "/abandoned/" .. b.id
if rank == 0 then
  t.ok(logged(b, "moved 3 checkpoint(s)"), "B says it moved A's future aside: " .. tostring(b.lines[#b.lines - 1]))
end
t.ok(ck.verify(aside .. "/step_00000005") and ck.verify(aside .. "/step_00000006"),
  "A's steps 4-6 are kept, moved aside")
t.eq(run_id(aside .. "/step_00000006"), a.id, "and they are A's")
train(b, 5, 7)
for s = 4, 7 do t.eq(run_id(step_of(s)), b.id, "step " .. s .. " in the folder is B's") end
t.ok(not ck.verify(step_of(3)), "retention (keep 4) counted B's line: A's step 3 went, B's 4-7 stayed")
t.ok(ck.verify(aside .. "/step_00000005") ~= nil, "retention left the moved-aside future alone")

-- a plain resume goes on from B, not from A's higher numbers
local c = manager(true)
t.eq(c.dir, step_of(7), "plain resume: B's newest")
t.eq(c:load(parts()), 8, "on from step 7")
t.eq(#c.line.forked, 2, "the line remembers both runs")
t.ok(c.line.forked[1].id == a.id and c.line.forked[1].step == 3 and c.line.forked[2].id == b.id and
  c.line.forked[2].step == 7, "A up to step 3, B up to step 7")

-- the newest does not verify: named, skipped; an explicit one is refused
local ref_index = ck.read_index(step_of(7))
sh_ok(string.format("truncate -s 100 '%s/rank_00001.bin'", step_of(7)))
local d = manager(true)
t.eq(d.dir, step_of(6), "a truncated newest is skipped")
t.ok(logged(d, "skipping " .. step_of(7) .. ": rank_00001.bin has 100 bytes, index.json says"),
  "and named with the reason: " .. tostring(d.lines[1]))
local ok, e = pcall(manager, step_of(7))
t.ok(not ok and options.is_usage_error(e) and tostring(e):find("is not a complete checkpoint: rank_00001.bin has 100",
  1, true), "--resume=PATH of a truncated checkpoint is refused: " .. tostring(e))
sh_ok(string.format("rm '%s/rank_00000.bin'", step_of(6)))
sh_ok(string.format("mkdir -p '%s' && : > '%s/index.json'", step_of(9), step_of(9)))
local f = manager(true)
t.eq(f.dir, step_of(5), "three bad ones skipped: an empty index, a truncated file, a missing file")
t.ok(logged(f, step_of(9) .. ": index.json: not valid JSON") and logged(f, step_of(6) .. ": rank_00000.bin is missing"),
  "each named: " .. table.concat(f.lines, " / "))
t.eq(f:load(parts()), 6, "the fallback loads")
t.ok(ref_index.step == 7, "(the skipped index itself was fine)")
sh_ok(string.format("rm -rf '%s' '%s' '%s'", step_of(9), step_of(7), step_of(6)))

-- a save killed between the renames that publish it over an existing step
-- (step_N moved to .old, the complete step_N.tmp not yet renamed): repaired
local g = manager(true)
t.eq(g:load(parts()), 6, "on from step 5")
sh_ok(string.format("mv '%s' '%s.old'", step_of(5), step_of(5)))
ck.save(step_of(5) .. ".tmp", { model = sh, optim = opt, step = 5, data = loader:state() })
local h = manager(true)
t.eq(h.dir, step_of(5), "a complete step_5.tmp becomes step_5 again")
t.ok(logged(h, "published only in part"), "and it says so")
t.ok(not ck.exists(step_of(5) .. ".old") and not ck.exists(step_of(5) .. ".tmp"), "the spare copy is removed")
t.eq(ck.read_index(step_of(5)).run, nil, "it is the newer copy (the one saved as .tmp)")
sh_ok(string.format("mv '%s' '%s.old'", step_of(5), step_of(5)))
local i = manager(true)
t.eq(i.dir, step_of(5), "with only step_5.old left, it is step_5 again")

-- resumed at or past the last step: nothing to train
t.eq(i:load(parts(5)), 6, "resumed at step 5")
t.ok(i.nothing_to_train and logged(i, "the checkpoint is at step 5, the run ends at step 5: nothing to train"),
  "--steps at the checkpoint's step leaves nothing to train")
local j = manager(true)
j:load(parts(9))
t.ok(not j.nothing_to_train, "--steps past it trains")
t.done()
