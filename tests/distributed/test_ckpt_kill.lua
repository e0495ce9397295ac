-- Crash safety and retention of checkpoint directories.
--   --phase=setup: train, save_step(root, 10), dump the saved values.
--   --phase=kill:  (FSDP_TEST_KILL_DURING_SAVE=1) train on, save_step(root, 20):
--                  rank 1 dies with part of its shard file written.
--   --phase=check: latest(root) is still step 10, which loads and equals the
--                  dump; the interrupted save left only root/step_00000020.tmp;
--                  later saves clean it up and keep the newest K.
--   mpirun -np 2 fsdp-lua tests/distributed/test_ckpt_kill.lua --phase=setup --dir=build/ckpt_test_kill
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local ck = require "fsdp.checkpoint"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local phase = assert(opts.phase, "--phase=setup|kill|check is required")
local rank = fsdp.rank()
local root = dir .. "/ckpt"

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local model, sh, opt = common.sharded { policy = "block" }
local loader = common.loader(2)

if phase == "setup" then
  if rank == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
  common.barrier(sh)
  for _ = 1, 3 do common.step(model, sh, opt, loader) end
  ck.save_step(root, 10, { model = sh, optim = opt, data = loader:state() })
  common.dump_slices(sh, opt, string.format("%s/ref_%d.safetensors", dir, rank))
  t.eq(ck.latest(root), root .. "/step_00000010", "latest after the first save")
elseif phase == "kill" then
  ck.load(ck.latest(root), { model = sh, optim = opt })
  for _ = 1, 2 do common.step(model, sh, opt, loader) end
  ck.save_step(root, 20, { model = sh, optim = opt })   -- rank 1 exits(9) in here
  t.ok(false, "the save should have been killed (is FSDP_TEST_KILL_DURING_SAVE=1 set?)")
elseif phase == "check" then
  t.ok(exists(root .. "/step_00000020.tmp/rank_00001.bin"), "the killed save left its temporary directory")
  t.ok(not exists(root .. "/step_00000020/index.json"), "no step_00000020 checkpoint appeared")
  local path, step = ck.latest(root)
  t.eq(path, root .. "/step_00000010", "latest() still points at the previous checkpoint")
  t.eq(step, 10, "latest() step")
  local ref, _, count = common.assemble(common.glob(dir .. "/ref_*.safetensors"))
  local info = ck.load(path, { model = sh, optim = opt })
  t.eq(info.step, 10, "the previous checkpoint loads")
  t.eq(opt.step_count, count, "its optimizer step count")
  local bad, first = common.compare_slices(sh, opt, ref, { "exp_avg", "exp_avg_sq" })
  t.ok(bad == 0, "and holds the values saved before the crash" .. (first and (": " .. first) or ""))
  -- saving again: the leftover goes, retention keeps the newest 2
  for s = 20, 40, 10 do
    common.step(model, sh, opt, loader)
    ck.save_step(root, s, { model = sh, optim = opt }, { keep = 2 })
  end
  common.barrier(sh)
  t.ok(not exists(root .. "/step_00000020.tmp/rank_00001.bin"), "a later save removed the leftover")
  t.ok(not exists(root .. "/step_00000010/index.json") and not exists(root .. "/step_00000020/index.json"),
    "keep = 2 removed the older checkpoints")
  t.ok(exists(root .. "/step_00000030/index.json") and exists(root .. "/step_00000040/index.json"),
    "keep = 2 kept the newest two")
  t.eq(ck.latest(root), root .. "/step_00000040", "latest() after more saves")
  -- overwriting a checkpoint of the same name replaces it
  ck.save(root .. "/step_00000040", { model = sh, optim = opt, step = 41 })
  t.eq(ck.read_index(root .. "/step_00000040").step, 41, "saving over an existing checkpoint replaces it")
  t.ok(not exists(root .. "/step_00000040.old/index.json"), "and removes the old one")
  t.eq(ck.latest(dir .. "/nothing_here"), nil, "latest() of an empty root is nil")
elseif phase == "kill_publish" then
  -- (FSDP_TEST_KILL_DURING_SAVE=publish) a save over the existing step 40:
  -- rank 0 dies after moving step_00000040 aside, before the new one is in place
  ck.load(root .. "/step_00000040", { model = sh, optim = opt })
  common.dump_slices(sh, opt, string.format("%s/ref40_%d.safetensors", dir, rank))
  ck.save(root .. "/step_00000040", { model = sh, optim = opt, step = 42, data = loader:state() })
  t.ok(false, "the save should have been killed (is FSDP_TEST_KILL_DURING_SAVE=publish set?)")
elseif phase == "recover" then
  t.ok(not exists(root .. "/step_00000040/index.json"), "the kill left no step_00000040")
  t.ok(exists(root .. "/step_00000040.old/index.json") and exists(root .. "/step_00000040.tmp/index.json"),
    "but the old copy and the complete new one beside it")
  t.eq(ck.latest(root), root .. "/step_00000030", "latest() alone sees only step 30")
  local lines = {}
  local run = ck.manager { save_dir = root, resume = true, log = function(...) lines[#lines + 1] = string.format(...) end }
  t.eq(run.dir, root .. "/step_00000040", "a resume repairs it: step_00000040 is there again")
  t.ok(lines[1] and lines[1]:find("published only in part", 1, true), "and says so: " .. tostring(lines[1]))
  t.eq(ck.read_index(run.dir).step, 42, "it is the new save (its index was complete)")
  t.ok(not exists(root .. "/step_00000040.old/index.json"), "the old copy is gone once the new one is in place")
  local ref = common.assemble(common.glob(dir .. "/ref40_*.safetensors"))
  ck.load(run.dir, { model = sh, optim = opt })
  local bad, first = common.compare_slices(sh, opt, ref, { "exp_avg", "exp_avg_sq" })
  t.ok(bad == 0, "and holds the values saved" .. (first and (": " .. first) or ""))
else
  error("unknown --phase " .. tostring(phase))
end
t.done()
