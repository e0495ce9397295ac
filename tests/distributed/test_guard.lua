-- fsdp.guard and the checkpoint writer keep non-finite training state out
-- of a run: a NaN or infinity planted on one rank (the loss, a gradient
-- shard, a parameter after the update) is one agreed verdict on every
-- rank, naming that rank and the value; "skip" drops the update and
-- leaves parameters and optimizer untouched; a save of non-finite state is
-- refused and retention keeps the last good checkpoint.
--   mpirun -np 3 fsdp-lua tests/distributed/test_guard.lua --dir=build/guard_test
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local ck = require "fsdp.checkpoint"
local guardlib = require "fsdp.guard"
local options = require "fsdp.options"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local rank, world = fsdp.rank(), fsdp.world()
local bad_rank = world - 1   -- the last rank (rank 0 when alone)
local root = dir .. "/ckpt"

local model, sh, opt = common.sharded { policy = "block" }
local loader = common.loader(3)
if rank == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
common.barrier(sh)

-- Runs fn; returns the stop error's status and message (nil when none).
local function stopped(fn)
  local ok, e = pcall(fn)
  if ok then return nil end
  t.ok(options.is_usage_error(e), "a clean stop, not a crash: " .. tostring(e))
  return e.status, tostring(e)
end

local lines = {}
local function log(...) lines[#lines + 1] = string.format(...) end

-- one step's forward and backward; the loss of this rank
local function forward_backward()
  local x, y = loader:next()
  local _, l = model(x, y)
  l:backward()
  return l:item()
end

local function values()   -- this rank's parameters and AdamW state, as numbers
  local v = {}
  for _, s in ipairs(sh.segments) do
    for _, x in ipairs(s.tensor:view(-1):tolist()) do v[#v + 1] = x end
    local st = opt.state[s.tensor]
    if st then for _, x in ipairs(st.exp_avg:view(-1):tolist()) do v[#v + 1] = x end end
  end
  return v
end

local function plant(tensor, value)
  fsdp.no_grad(function() tensor:view(-1):narrow(1, 1, 1):fill(value) end)
end

-- a finite step goes through, and a checkpoint is saved from it
local g = guardlib.new { model = sh, mode = "stop", what = "test", log = log }
local loss = forward_backward()
local norm = sh:grad_norm()
t.ok(g:check_step { step = 1, loss = loss, grad_norm = norm }, "a finite step is applied")
opt:step()
g:check_params(1)
sh:zero_grad()
ck.save_step(root, 1, { model = sh, optim = opt, data = loader:state() }, { keep = 1 })

-- 1. the loss of one rank is NaN: every rank stops, naming it
loss = forward_backward()
norm = sh:grad_norm()
local status, msg = stopped(function()
  g:check_step { step = 2, loss = rank == bad_rank and 0 / 0 or loss, grad_norm = norm }
end)
t.eq(status, guardlib.EXIT, "a NaN loss on one rank stops every rank with the guard's exit status")
t.ok(msg and msg:find("test: step 2: the loss is nan on rank " .. bad_rank .. ":", 1, true), "it names the step, "
  .. "the value and the rank: " .. tostring(msg))
t.ok(msg and not msg:find("gradient"), "and only the loss (the gradients are finite)")
sh:zero_grad()

-- 2. an infinite gradient on one rank's shard: the norm, named on that rank
forward_backward()
if rank == bad_rank then plant(sh.grads[#sh.grads], math.huge) end
norm = sh:grad_norm()
t.ok(norm ~= norm or norm == math.huge, "the planted gradient makes the global norm non-finite")
status, msg = stopped(function() g:check_step { step = 3, loss = 1.0, grad_norm = norm } end)
t.eq(status, guardlib.EXIT, "an infinite gradient stops the run")
t.ok(msg and msg:find("the gradient norm is inf on rank " .. bad_rank, 1, true), "naming the rank: " .. tostring(msg))
sh:zero_grad()

-- 3. skip: the update is dropped on every rank, counted and logged
local skipper = guardlib.new { model = sh, mode = "skip", what = "test", log = log }
loss = forward_backward()
norm = sh:grad_norm()
local before, steps_before = values(), opt.step_count
local apply = skipper:check_step { step = 4, loss = rank == bad_rank and -math.huge or loss, grad_norm = norm }
t.eq(apply, false, "skip: the step's update is dropped on every rank")
if apply then opt:step() end
sh:zero_grad()
t.eq(skipper.skipped, 1, "and counted")
t.eq(opt.step_count, steps_before, "the optimizer did not step")
local after, same = values(), true
for i = 1, #before do same = same and before[i] == after[i] end
t.ok(same and #after == #before, "parameters and optimizer state are as they were")
if rank == 0 then
  t.ok(lines[#lines] and lines[#lines]:find("step     4 | skipped (update dropped): the loss is -inf on rank "
    .. bad_rank, 1, true), "the skip is logged: " .. tostring(lines[#lines]))
end
loss = forward_backward()
t.ok(skipper:check_step { step = 5, loss = loss, grad_norm = sh:grad_norm() }, "the next finite step is applied")
opt:step()
sh:zero_grad()

-- 4. a parameter made non-finite by the update: stops in both modes, naming it
local seg = sh.segments[1]
if rank == bad_rank then plant(seg.tensor, 0 / 0) end
status, msg = stopped(function() skipper:check_params(5) end)
t.eq(status, guardlib.EXIT, "a NaN parameter after the update stops even a skipping run")
t.ok(msg and msg:find("step 5: parameter '" .. seg.path .. "' is nan on rank " .. bad_rank .. " after the update",
  1, true), "naming the parameter and the rank: " .. tostring(msg))

-- 5. no checkpoint is written from that state, and retention keeps the good one
local ok, err = pcall(ck.save_step, root, 5, { model = sh, optim = opt, data = loader:state() }, { keep = 1 })
t.ok(not ok, "a save of a NaN parameter is refused")
t.ok(tostring(err):find("parameter '" .. seg.path .. "' holds NaN or infinity on rank " .. bad_rank, 1, true),
  "the refusal names the parameter and the rank: " .. tostring(err))
common.barrier(sh)
t.eq(ck.latest(root), root .. "/step_00000001", "keep = 1 kept the last checkpoint of finite state")
t.ok(not fsdp.checkpoint.exists(root .. "/step_00000005"), "nothing was published for step 5")
local ok2 = pcall(ck.load, root .. "/step_00000001", { model = sh, optim = opt })
t.ok(ok2, "the kept checkpoint loads")

-- 6. a fresh guard checks the parameters it starts from (a bad --init)
if rank == bad_rank then plant(seg.tensor, math.huge) end
local g2 = guardlib.new { model = sh, what = "test" }
status, msg = stopped(function() g2:check_step { step = 1, loss = 1.0, grad_norm = 1.0 } end)
t.ok(status == guardlib.EXIT and msg:find("is inf on rank " .. bad_rank .. " before the step", 1, true),
  "the first check covers the starting parameters: " .. tostring(msg))
t.done()
