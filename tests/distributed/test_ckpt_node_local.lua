-- Ranks that do not share the save folder's filesystem (node-local disks):
-- rank 1 runs in a mount namespace of its own with a tmpfs over the folder
-- (ckpt_node_local.sh). A save must refuse, naming rank 1, and publish
-- nothing, whether rank 1 sees no folder at all or a leftover step_N.tmp of
-- an earlier save on its own disk.
--   bash tests/distributed/ckpt_node_local.sh MPIRUN... -- LAUNCHER DIR
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local ck = require "fsdp.checkpoint"
local common = require "ckpt_common"

local opts = ... or {}
local root = assert(opts.dir, "--dir=DIR is required") .. "/ckpt"
local rank = fsdp.rank()

local model, sh, opt = common.sharded { policy = "block" }
local loader = common.loader(2)
common.step(model, sh, opt, loader)
local state = { model = sh, optim = opt, data = loader:state() }

local ok, err = pcall(ck.save_step, root, 1, state)
t.ok(not ok, "a save rank 1 cannot see is refused")
t.ok(tostring(err):find("rank 1 does not see " .. root .. "/step_00000001.tmp, which rank 0 created", 1, true)
  and tostring(err):find("node-local disks are refused", 1, true), "naming rank 1 and why: " .. tostring(err))
if rank == 0 then t.ok(not ck.exists(ck.step_dir(root, 1)), "nothing was published") end

-- rank 1's disk holds step_00000002.tmp from a killed run (the script left it)
ok, err = pcall(ck.save_step, root, 2, state)
t.ok(not ok and tostring(err):find("rank 1 sees another " .. root .. "/step_00000002.tmp than rank 0", 1, true),
  "a leftover step_N.tmp on rank 1's own disk is not taken for rank 0's folder: " .. tostring(err))
if rank == 0 then t.ok(not ck.exists(ck.step_dir(root, 2)), "nothing was published") end
t.done()
