-- fsdp.shard on one rank (no mpirun): the bookkeeping around the schedule.
-- Multi-rank behaviour is in tests/distributed.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"

local function flat(x) return x:float():contiguous():view(-1):tolist() end
local function grad_sum(sh)
  local s = 0
  for _, g in ipairs(sh.grads) do for _, v in ipairs(flat(g)) do s = s + v end end
  return s
end

-- zero_grad also drops what no_sync kept
do
  local m = nn.Linear(3, 2)
  local sh = fsdp.shard(m, { seed = 1 })
  local x = fsdp.tensor({ { 1, 2, 3 } })
  local function step() m(x):sum():backward() end
  step()
  local once = grad_sum(sh)
  sh:zero_grad()
  sh:no_sync(step)        -- a micro-batch thrown away
  sh:zero_grad()
  step()
  t.near(grad_sum(sh), once, 1e-6, "zero_grad drops gradients kept by no_sync")
  local opt = optim.SGD(sh:parameters(), { lr = 0.1 })
  sh:no_sync(step)
  opt:zero_grad()          -- the optimizer's zero_grad reaches the sharded model
  step()
  t.near(grad_sum(sh), once, 1e-6, "the optimizer's zero_grad does too")
end

-- full_state_dict: the f32 masters, recording nothing
do
  local cfg = { vocab_size = 64, n_layer = 1, n_head = 2, n_embd = 16, block_size = 8 }
  local ref = nn.GPT(cfg):materialize { seed = 4 }
  local m = nn.GPT(cfg)
  local sh = fsdp.shard(m, { policy = fsdp.policy.per_block(), seed = 4, mixed_precision = { compute = "bf16" } })
  local before = fsdp.tape_size()
  local sd = sh:full_state_dict()
  t.eq(fsdp.tape_size(), before, "full_state_dict records nothing on the tape")
  local worst = 0
  for _, p in ipairs(ref:named_parameters()) do
    local a, b = flat(sd[p.path]), flat(p.tensor)
    for i = 1, #b do worst = math.max(worst, math.abs(a[i] - b[i])) end
  end
  t.eq(worst, 0, "full_state_dict gives the f32 masters even with bf16 compute")
end

-- a shared module: listed once, initialized once, sharded once
do
  local Pair = nn.Module:extend("Pair")
  function Pair:__init()
    local lin = nn.Linear(4, 4)
    self:add("a", lin)
    self:add("b", lin)
  end
  function Pair:forward(x) return self.b(self.a(x)) end
  local m = Pair()
  t.eq(#m:named_parameters(), 2, "a shared module's parameters are listed once")
  t.eq(#m:named_parameters(true), 4, "... or under every path when asked")
  m:materialize { seed = 2 }
  t.ok(m.a.weight == m.b.weight, "materialize allocates a shared parameter once")
  local s2 = fsdp.shard(Pair(), { seed = 2 })
  t.eq(#s2.units[1].params, 2, "the unit flattens a shared parameter once")
  local Clash = nn.Module:extend("Clash")
  function Clash:__init()
    self:param("w", { 2 })
    self:add("w", nn.Linear(2, 2))
  end
  t.raises(function() Clash() end, { "child name 'w' is taken" }, "a child named like a parameter")
end

-- parameter groups are the same two on every rank; an empty one is fine
do
  local sh = fsdp.shard(nn.LayerNorm(5), { seed = 1 })
  local groups = sh:param_groups(0.1)
  t.eq(#groups, 2, "two groups always")
  t.eq(#groups[1].params, 0, "no matrices here: the decay group is empty")
  local opt = optim.AdamW(groups, { lr = 1e-2 })
  t.no_error(function() opt:step() end, "an optimizer with an empty group steps")
  local empty = optim.AdamW({}, { lr = 1e-2 })
  t.no_error(function() empty:step() end, "an optimizer over no parameters (a rank holding only padding) steps")
end

-- activation checkpointing keeps every argument and result
do
  local Scaled = nn.Module:extend("Scaled")
  function Scaled:__init() self:add("lin", nn.Linear(3, 3)) end
  function Scaled:forward(x, s) return self.lin(x) * s, "second" end
  local m = Scaled():materialize { seed = 3 }
  local x = fsdp.randn(2, 3, { seed = 5, requires_grad = true })
  local y1, tag1 = m(x, 0.5)
  y1:sum():backward()
  local g1 = flat(x:get_grad())
  x:zero_grad()
  nn.recompute(m)
  local y2, tag2 = m(x, 0.5)
  y2:sum():backward()
  t.eq(tag2, tag1, "a recomputed module returns every result")
  t.all_near(flat(y2), flat(y1), 1e-7, "same output with an extra argument")
  t.all_near(flat(x:get_grad()), g1, 1e-7, "same input gradient")
end

-- a failure halfway through fsdp.shard leaves the model as it was
do
  local cfg = { vocab_size = 64, n_layer = 2, n_head = 2, n_embd = 32, block_size = 8 }
  local m = nn.GPT(cfg)
  local used = fsdp.memory.stats().current
  fsdp.memory.empty_cache()
  fsdp.memory.set_cap(used + 40000)
  local ok, err = pcall(fsdp.shard, m, { policy = fsdp.policy.per_block(), seed = 1 })
  fsdp.memory.set_cap(0)
  t.ok(not ok and tostring(err):find("cap", 1, true), "shard fails under a small cap: " .. tostring(err))
  local sh = fsdp.shard(m, { policy = fsdp.policy.per_block(), seed = 1 })
  local ids = fsdp.tensor({ { 1, 2, 3 } }, { dtype = "i64" })
  local _, loss = m(ids, ids)
  t.ok(loss and loss:item() > 0, "the same model shards and runs after the failure")
  t.ok(#sh.units == 3, "three units")
end

-- Sharded:clip_grad_norm scales by optim.clip_coef's factor, and refuses a
-- max_norm that is not a number >= 0 (a negative one used to flip the
-- gradients' sign) with the gradients left as they were
do
  local cfg = { vocab_size = 29, n_layer = 1, n_head = 2, n_embd = 8, block_size = 8 }
  local m = nn.GPT(cfg)
  local sh = fsdp.shard(m, { policy = fsdp.policy.per_block(), seed = 7 })
  local x, y = t.token_batch(3, 2, 5, cfg.vocab_size)
  local _, loss = m(x, y)
  loss:backward()
  local before = t.grad_lists(sh)
  local norm = sh:grad_norm()
  t.ok(norm > 0.2, string.format("the gradients have a norm to clip (%.3g)", norm))
  for _, bad in ipairs({ -1, 0 / 0, "1" }) do
    t.raises(function() sh:clip_grad_norm(bad) end, { "Sharded:clip_grad_norm", "max_norm >= 0" },
      "clip_grad_norm(" .. tostring(bad) .. ")")
  end
  t.eq(t.max_abs_diff(t.grad_lists(sh), before), 0, "a refused clip leaves the gradients alone")
  t.eq(sh:clip_grad_norm(0.1), norm, "clip_grad_norm returns the norm before clipping")
  local coef, worst = optim.clip_coef(norm, 0.1), 0
  for i, g in ipairs(t.grad_lists(sh)) do
    for j, v in ipairs(g) do worst = math.max(worst, math.abs(v - before[i][j] * coef)) end
  end
  t.ok(coef < 1 and worst <= 1e-7 * norm, string.format("the gradients scaled by clip_coef %.4g (max err %.3g)", coef,
    worst))
  t.near(sh:grad_norm(), 0.1, 1e-5, "the clipped norm is max_norm")
end

-- per_block: a unit per block, and units of their own for the untied
-- vocabulary tables (a Llama's token embedding and head); a GPT's tied
-- embedding cannot be one and stays with the root
do
  local function unit_paths(m)
    local sh = fsdp.shard(m, { policy = fsdp.policy.per_block(), seed = 3 })
    local paths = {}
    for i, u in ipairs(sh.units) do paths[i] = u.name end
    table.sort(paths)
    return table.concat(paths, " ")
  end
  local cfg = { vocab_size = 37, n_layer = 3, n_head = 2, n_embd = 8, block_size = 8 }
  t.eq(unit_paths(nn.Llama(cfg)), "h.0 h.1 h.2 lm_head root wte", "per_block on a Llama")
  t.eq(unit_paths(nn.GPT(cfg)), "h.0 h.1 h.2 root", "per_block on a GPT (tied embedding in the root)")
end

-- print(sharded): the module tree, each unit marked (name, parameters, this rank's shard)
do
  local nn = require "fsdp.nn"
  local seq = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
  local sh = fsdp.shard(seq, { policy = fsdp.policy.by_type("Linear") })
  local text = tostring(sh)
  for _, want in ipairs { "Sharded Sequential: full_shard, 3 unit(s), 1 rank(s) (shard group of 1), compute f32",
                          "  Sequential  <unit root: 0 parameters, shard 1>",   -- an empty unit pads to one element
                          "    0: Linear  <unit 0: 20 parameters, shard 20>",   -- 3 x 5 + 5
                          "    1: ReLU\n",
                          "    2: Linear  <unit 2: 12 parameters, shard 12>" } do   -- 5 x 2 + 2
    t.ok(text:find(want, 1, true) ~= nil, "print(sharded) shows '" .. want:gsub("\n", "") .. "':\n" .. text)
  end
  t.ok(not text:find("table: 0x", 1, true) and not text:find("cdata", 1, true), "no table or cdata dump")
end

t.done()
