-- FSDP2 controls: explicit forward/backward prefetch lists per unit
-- (sharded:set_prefetch) and an unshard on request, synchronous or issued
-- asynchronously (sharded:unshard(unit, { async = true }) -> handle:wait()).
-- They change when gathers happen, never what is computed: losses, gradient
-- shards and parameters after three AdamW steps equal the default
-- schedule's (1e-6; in practice bit for bit). The planner shows what the
-- lists cost: the same bytes gathered per step, and more gathered buffers
-- alive at once when they prefetch two blocks ahead past the gather limit.
--   mpirun -np 3 fsdp-lua tests/distributed/test_fsdp_prefetch.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local planner = require "fsdp.plan"
local dist = fsdp.distributed

local rank, world = dist.rank(), dist.world()
-- rows per rank, sizes that no rank count divides
local cfg = { vocab_size = 97, n_layer = 4, n_head = 3, n_embd = 21, block_size = 8 }
local B, T, STEPS = 2, 8, 3
local blocks = { "h.0", "h.1", "h.2", "h.3" }

local function batch(step) return t.token_batch(step * 7919 + rank * 104729 + 17, B, T, cfg.vocab_size) end

-- setup(sharded, step) applies a variant's controls; returns losses, and
-- the gradient shards and parameters after the last step
local function train(setup, steps)
  local model = nn.GPT(cfg)
  local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 7 })
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 3e-3, betas = { 0.9, 0.95 } })
  if setup.once then setup.once(sharded) end
  return t.train_sharded(model, sharded, opt, batch, steps or STEPS,
    setup.each and function(step) setup.each(sharded, step) end)
end

local worst_diff = t.max_abs_diff

local variants = {
  ["two ahead"] = { once = function(sh)
    -- forward: each block gathers the next two; backward: the two before it
    for i, b in ipairs(blocks) do
      sh:set_prefetch(b, { forward = { blocks[i + 1], blocks[i + 2] }, backward = { blocks[i - 1], blocks[i - 2] } })
    end
    sh:set_prefetch("root", { forward = { "h.0", "h.1" }, backward = { "h.3", "h.2" } })
  end },
  ["no prefetch"] = { once = function(sh)
    for _, b in ipairs(blocks) do sh:set_prefetch(b, { forward = {}, backward = {} }) end
    sh:set_prefetch("root", { forward = {}, backward = {} })
  end },
  ["lists then default again"] = { once = function(sh)
    sh:set_prefetch("h.1", { forward = { "h.3" }, backward = { "root" } })
    sh:set_prefetch("h.1", { forward = false, backward = false })
  end },
  ["async unshard"] = { each = function(sh, step)
    -- the first block's gather runs while the root's embedding computes;
    -- the last block is gathered synchronously and freed again
    local h = sh:unshard("h.0", { async = true })
    if step == 2 then h:wait() end
    sh:unshard("h.3")
    sh:reshard("h.3")
  end },
}

local ref = train({})
for _, name in ipairs({ "two ahead", "no prefetch", "lists then default again", "async unshard" }) do
  local got = train(variants[name])
  local dl = 0
  for s = 1, STEPS do dl = math.max(dl, math.abs(got.losses[s] - ref.losses[s])) end
  local dg, dp = worst_diff(got.grads, ref.grads), worst_diff(got.params, ref.params)
  t.ok(dl <= 1e-6 and dg <= 1e-6 and dp <= 1e-6, string.format("rank %d of %d: %s: losses, gradient shards and "
    .. "parameters equal the default schedule's (max diff %.3g, %.3g, %.3g)", rank, world, name, dl, dg, dp))
end
t.ok(ref.losses[1] > 4 and ref.losses[1] < 5.5, string.format("first loss %.4f is about ln(97) = 4.57", ref.losses[1]))

-- the planner: what each setting gathers and holds (this rank of this world)
local function plan(setup)
  return planner.run(function() train(setup, 2) end, { world = world, rank = rank })
end
local pd, p2, p0 = plan({}), plan(variants["two ahead"]), plan(variants["no prefetch"])
t.eq(p2.traffic.gathered_bytes, pd.traffic.gathered_bytes, "prefetch lists gather the same bytes per step")
t.eq(p0.traffic.gathered_bytes, pd.traffic.gathered_bytes, "no prefetch gathers the same bytes per step")
local block_bytes = 0
for _, u in ipairs(pd.units) do if u.name == "h.1" then block_bytes = 4 * u.padded end end
if world > 1 then
  t.ok(p2.memory.param.peak >= pd.memory.param.peak + block_bytes, string.format("rank %d: two ahead holds at "
    .. "least one more gathered block (%d B) at its peak: param %d B against %d", rank, block_bytes,
    p2.memory.param.peak, pd.memory.param.peak))
  t.ok(p0.memory.param.peak < pd.memory.param.peak, string.format("rank %d: no prefetch holds fewer gathered "
    .. "buffers at once: param %d B against %d", rank, p0.memory.param.peak, pd.memory.param.peak))
end
dist.print0("planned param peak per rank of %d: default %d B, two ahead %d B, no prefetch %d B; gathered %d B per "
  .. "step in each", world, pd.memory.param.peak, p2.memory.param.peak, p0.memory.param.peak,
  pd.traffic.gathered_bytes)

-- bad input: an unknown unit, a unit prefetching itself, a misspelled phase
local sh = fsdp.shard(nn.GPT(cfg), { policy = fsdp.policy.per_block(), seed = 7 })
t.raises(function() sh:set_prefetch("h.0", { forward = { "h.9" } }) end,
  { "sharded:set_prefetch", "no unit named 'h.9'", "rank " .. rank, "root, h.0, h.1, h.2, h.3" }, "an unknown unit")
t.raises(function() sh:set_prefetch("h.7", { forward = { "h.1" } }) end, { "no unit named 'h.7'" },
  "an unknown unit to set")
t.raises(function() sh:set_prefetch("h.1", { backward = { "h.1" } }) end, { "'h.1' cannot prefetch itself" },
  "a unit prefetching itself")
t.raises(function() sh:set_prefetch("h.1", { forwards = { "h.2" } }) end, { "forwards" }, "a misspelled phase")
t.raises(function() sh:unshard("h.5", { async = true }) end, { "sharded:unshard", "no unit named 'h.5'" },
  "unshard of an unknown unit")
t.done()
