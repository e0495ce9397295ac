-- Resharding: a checkpoint saved by 4 ranks (full_shard, per-block units;
-- hybrid_shard with groups of 2 and no_shard, where only the first replica
-- group writes)
-- loads on 1, 2 or 3 ranks under another wrap policy, and into an unsharded
-- module: parameters and AdamW state equal the saved values exactly.
--   mpirun -np 4 fsdp-lua tests/distributed/test_ckpt_reshard.lua --phase=save --dir=build/ckpt_test_reshard
--   mpirun -np 3 fsdp-lua tests/distributed/test_ckpt_reshard.lua --phase=load --dir=build/ckpt_test_reshard --policy=size
-- The save phase also dumps every rank's slices with plain safetensors
-- (ref_*), which the load phase assembles into the expected full values.
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local ck = require "fsdp.checkpoint"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local phase = opts.phase or "load"
local rank, world = fsdp.rank(), fsdp.world()
local STEPS = 3

local variants = {
  { name = "full", strategy = "full_shard", policy = "block" },
  { name = "hybrid", strategy = "hybrid_shard", group_size = 2, policy = "custom", files = 2 },
  { name = "noshard", strategy = "no_shard", policy = "size", files = 1 },
}

if phase == "save" then
  if rank == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
  for _, v in ipairs(variants) do
    local model, sh, opt = common.sharded { policy = v.policy, strategy = v.strategy, group_size = v.group_size }
    common.barrier(sh)
    local loader = common.loader(3)
    for step = 1, STEPS do common.step(model, sh, opt, loader) end
    ck.save(dir .. "/" .. v.name, { model = sh, optim = opt, step = STEPS, data = loader:state(),
      rng = { seed = 5, offset = 123 }, extra = { note = v.name } })
    common.dump_slices(sh, opt, string.format("%s/ref_%s_%d.safetensors", dir, v.name, rank))
    common.barrier(sh)
    local index = ck.read_index(dir .. "/" .. v.name)
    t.eq(index.world_size, world, v.name .. ": world size in the index")
    t.eq(#index.files, v.files or world, v.name .. ": files (replicas: the first replica group only)")
    t.eq(index.strategy, v.strategy, v.name .. ": strategy")
  end
  t.done()
  return
end

-- load: another policy, this many ranks
local policy = opts.policy or "size"
for _, v in ipairs(variants) do
  local ref, steps, count = common.assemble(common.glob(string.format("%s/ref_%s_*.safetensors", dir, v.name)))
  local model, sh, opt = common.sharded { policy = policy, seed = 99 }
  local before = sh:full_state_dict()
  local info = ck.load(dir .. "/" .. v.name, { model = sh, optim = opt })
  t.eq(info.step, STEPS, v.name .. ": step")
  t.eq(info.extra and info.extra.note, v.name, v.name .. ": extra")
  t.eq(info.rng and info.rng.offset, 123, v.name .. ": rng")
  t.ok(type(info.data) == "table" and info.data.index == STEPS, v.name .. ": data-loader state")
  t.eq(opt.step_count, count, v.name .. ": optimizer step count")
  local bad, first = common.compare_slices(sh, opt, ref, { "exp_avg", "exp_avg_sq" })
  t.ok(bad == 0, string.format("%s on %d rank(s), policy %s: parameters and AdamW state equal the saved ones "
    .. "(%d mismatches%s)", v.name, world, policy, bad, first and (", first: " .. first) or ""))
  local st_bad = 0
  for _, s in ipairs(sh.segments) do
    local state = opt.state[s.tensor]
    if not state or state.step ~= steps[s.path] then st_bad = st_bad + 1 end
  end
  t.eq(st_bad, 0, v.name .. ": per-parameter AdamW steps restored")
  local full = sh:full_state_dict()
  local fbad, ffirst = common.compare_full(full, ref)
  t.ok(fbad == 0, v.name .. ": full_state_dict equals the saved parameters" .. (ffirst and (": " .. ffirst) or ""))
  t.ok(before["wpe.weight"]:tolist()[1][1] ~= full["wpe.weight"]:tolist()[1][1], v.name .. ": values changed on load")
  -- training goes on from the loaded state
  local loader = common.loader(3)
  loader:set_state(info.data)
  local loss = common.step(model, sh, opt, loader)
  t.ok(loss == loss and loss > 0 and loss < 10, v.name .. ": a step after loading gives a sane loss " .. loss)
end

-- one process: the same checkpoint into an unsharded module
if world == 1 then
  for _, v in ipairs(variants) do
    local ref = common.assemble(common.glob(string.format("%s/ref_%s_*.safetensors", dir, v.name)))
    local model, opt = common.plain { seed = 99 }
    ck.load(dir .. "/" .. v.name, { model = model, optim = opt })
    local sd = model:state_dict()
    local bad, first = common.compare_full(sd, ref)
    t.ok(bad == 0, v.name .. ": unsharded module gets the saved parameters" .. (first and (": " .. first) or ""))
    local sbad = 0
    for _, p in ipairs(model:named_parameters()) do
      local state = opt.state[p.tensor]
      for _, nm in ipairs({ "exp_avg", "exp_avg_sq" }) do
        local got = state and state[nm]:view(-1):tolist() or {}
        local want = ref[nm][p.path]
        for j = 1, #want do if got[j] ~= want[j] then sbad = sbad + 1 end end
      end
    end
    t.eq(sbad, 0, v.name .. ": unsharded module gets the saved AdamW state")
    -- and an unsharded save loads back into a sharded model
    local d2 = string.format("%s/plain_%s", dir, v.name)
    ck.save(d2, { model = model, optim = opt, step = 7 })
    local _, sh, opt2 = common.sharded { policy = "block", seed = 5 }
    local info = ck.load(d2, { model = sh, optim = opt2 })
    t.eq(info.step, 7, v.name .. ": unsharded checkpoint step")
    local bad2 = common.compare_slices(sh, opt2, ref, { "exp_avg", "exp_avg_sq" })
    t.eq(bad2, 0, v.name .. ": unsharded checkpoint loads into a sharded model")
  end
end
-- SGD with momentum: its buffers travel too (one more step agrees exactly)
do
  local ma, sa, oa = common.sharded { policy = "block", sgd = true }
  local la = common.loader(8)
  for _ = 1, 2 do common.step(ma, sa, oa, la, 1e-2) end
  ck.save(dir .. "/sgd_" .. world, { model = sa, optim = oa, step = 2, data = la:state() })
  local mb, sb, ob = common.sharded { policy = "none", sgd = true, seed = 1 }
  local lb = common.loader(8)
  lb:set_state(ck.load(dir .. "/sgd_" .. world, { model = sb, optim = ob }).data)
  local l1, l2 = common.step(ma, sa, oa, la, 1e-2), common.step(mb, sb, ob, lb, 1e-2)
  t.eq(l1, l2, "SGD: the step after loading gives the same loss")
  local fa, fb = sa:full_state_dict(), sb:full_state_dict()
  local nbad = 0
  for path, v in pairs(fa) do
    local x, y = v:view(-1):tolist(), fb[path]:view(-1):tolist()
    for i = 1, #x do if x[i] ~= y[i] then nbad = nbad + 1 end end
  end
  t.eq(nbad, 0, "SGD: momentum buffers restored (parameters equal after one more step)")
end

if rank == 0 then print(string.format("reshard: loaded 4-rank checkpoints on %d rank(s), policy %s", world, policy)) end
t.done()
