-- Exact resume: 20 steps straight equal 10 steps, save, exit, load in a new
-- process, 10 more steps. Bit for bit (losses and final parameters) on the
-- same rank count; within 1e-6 relative after a change of rank count.
--   mpirun -np 2 fsdp-lua tests/distributed/test_ckpt_resume.lua --phase=straight --dir=D   (20 steps, the reference)
--   mpirun -np 2 fsdp-lua tests/distributed/test_ckpt_resume.lua --phase=first --dir=D      (10 steps, save, exit)
--   mpirun -np 2 fsdp-lua tests/distributed/test_ckpt_resume.lua --phase=second --dir=D     (load, 10 steps, compare)
-- --dropout=0.1 puts dropout in the model, so the RNG position must be
-- restored too (only meaningful on the same rank count: masks follow the
-- local batch). The LR follows a warmup-cosine schedule of the step; the
-- data loader shuffles, so its position must be restored as well.
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local st = require "fsdp.safetensors"
local ck = require "fsdp.checkpoint"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local phase = assert(opts.phase, "--phase=straight|first|second is required")
local rank, world = fsdp.rank(), fsdp.world()
local TOTAL, HALF = 20, 10
local rng = nn.Dropout and require("fsdp.nn.layers").dropout_rng

local cfg = {}
for k, v in pairs(common.cfg) do cfg[k] = v end
cfg.dropout = opts.dropout
local model, sh, opt = common.sharded { cfg = cfg, policy = opts.policy or "block" }
nn.manual_seed(11)
local loader = common.loader(5)
local lr_at = optim.schedule.cosine(3e-3, 3, TOTAL, 3e-4)

if phase ~= "second" and rank == 0 then
  os.execute("mkdir -p '" .. dir .. "'" .. (phase == "first" and (" && rm -rf '" .. dir .. "/ckpt'") or ""))
end
common.barrier(sh)

local function train(from, to, losses)
  for step = from, to do losses[step] = common.step(model, sh, opt, loader, lr_at(step)) end
end

local function write_result(name, losses)
  local sd = sh:full_state_dict()
  if rank == 0 then
    st.save(string.format("%s/%s.safetensors", dir, name), sd)
    common.write_json(string.format("%s/%s.json", dir, name), { losses = losses, world = world })
  end
end

if phase == "straight" then
  local losses = {}
  train(1, TOTAL, losses)
  t.ok(losses[TOTAL] < losses[1], string.format("the straight run trains (loss %.4f -> %.4f)", losses[1], losses[TOTAL]))
  write_result("straight", losses)
elseif phase == "first" then
  local losses = {}
  train(1, HALF, losses)
  ck.save_step(dir .. "/ckpt", HALF, { model = sh, optim = opt, data = loader:state(),
    rng = { dropout_seed = rng.seed, dropout_offset = rng.offset }, schedule = { step = HALF } }, { keep = 2 })
  t.ok(ck.exists(ck.step_dir(dir .. "/ckpt", HALF)), "the first half saved a complete checkpoint")
  if rank == 0 then common.write_json(dir .. "/first.json", { losses = losses, world = world }) end
elseif phase == "second" then
  local path, step = ck.latest(dir .. "/ckpt")
  t.eq(step, HALF, "latest() finds the checkpoint of step 10")
  local info = ck.load(path, { model = sh, optim = opt })
  t.eq(info.step, HALF, "saved step")
  t.eq(info.schedule and info.schedule.step, HALF, "schedule position")
  loader:set_state(info.data)
  rng.seed, rng.offset = info.rng.dropout_seed, info.rng.dropout_offset
  local first = common.read_json(dir .. "/first.json")
  local losses = {}
  for i = 1, HALF do losses[i] = first.losses[i] end
  train(HALF + 1, TOTAL, losses)
  local ref = common.read_json(dir .. "/straight.json")
  local exact = first.world == world and ref.world == world
  local tol = exact and 0 or 1e-6
  local worst = 0
  for s = 1, TOTAL do
    local rel = math.abs(losses[s] - ref.losses[s]) / math.abs(ref.losses[s])
    worst = math.max(worst, rel)
    t.ok(rel <= tol, string.format("step %d: loss %.17g, straight run %.17g (rel %.3g)", s, losses[s],
      ref.losses[s], rel))
  end
  local want = st.load(dir .. "/straight.safetensors")
  local got = sh:full_state_dict()
  local num, den, nbad = 0, 0, 0
  for path, w in pairs(want) do
    local a, b = got[path]:view(-1):tolist(), w:view(-1):tolist()
    for i = 1, #b do
      if a[i] ~= b[i] then nbad = nbad + 1 end
      num, den = num + (a[i] - b[i]) ^ 2, den + b[i] ^ 2
    end
  end
  local rel = math.sqrt(num / den)
  if exact then
    t.eq(nbad, 0, string.format("final parameters equal the straight run bit for bit (%d ranks)", world))
  else
    t.ok(rel <= 1e-6, string.format("final parameters within 1e-6 of the straight run after %d -> %d ranks "
      .. "(relative error %.3g)", first.world, world, rel))
  end
  if rank == 0 then
    print(string.format("resume on %d rank(s) (saved by %d): worst loss rel %.3g, parameters rel %.3g, %d differ",
      world, first.world, worst, rel, nbad))
  end
else
  error("unknown --phase " .. tostring(phase))
end
t.done()
