-- A checkpoint of a GPT whose tied embedding is a sliced unit (head_chunk:
-- its shards padded to whole rows) saved by 4 ranks loads on 3 ranks with
-- another chunk size and on 2 ranks without head_chunk (the embedding back
-- with the root): every parameter equals the saved value exactly.
--   mpirun -np 4 fsdp-lua tests/distributed/test_ckpt_head_chunk.lua --phase=save --dir=DIR --chunk=30
--   mpirun -np 3 fsdp-lua tests/distributed/test_ckpt_head_chunk.lua --phase=load --dir=DIR --chunk=7
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local ck = require "fsdp.checkpoint"
local st = require "fsdp.safetensors"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local cfg = {}
for k, v in pairs(common.cfg) do cfg[k] = v end
cfg.head_chunk = opts.chunk
local model, sh, opt = common.sharded { policy = "block", cfg = cfg }
local sliced = false
for _, u in ipairs(sh.units) do sliced = sliced or u.sliced == true end
t.eq(sliced, opts.chunk ~= nil, "the tied embedding is a sliced unit exactly when head_chunk is set")
if opts.phase == "save" then
  if fsdp.rank() == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
  common.barrier(sh)
  local loader = common.loader(3)
  for _ = 1, 2 do common.step(model, sh, opt, loader) end
  ck.save(dir .. "/ckpt", { model = sh, optim = opt, step = 2 })
  local sd = sh:full_state_dict()
  if fsdp.rank() == 0 then st.save(dir .. "/ref.safetensors", sd) end
  common.barrier(sh)
else
  ck.load(dir .. "/ckpt", { model = sh, optim = opt })
  local sd, ref = sh:full_state_dict(), st.load(dir .. "/ref.safetensors")
  local worst, n = 0, 0
  for k, v in pairs(ref) do
    worst = math.max(worst, t.rel_err(sd[k], v))
    n = n + 1
  end
  t.ok(n > 10, string.format("%d saved tensors", n))
  t.eq(worst, 0, string.format("rank %d of %d: every loaded parameter equals the saved one", fsdp.rank(), fsdp.world()))
end
t.done()
