-- Frozen parameters under fsdp.shard, against an unsharded model with the
-- same freezing: the whole block h.0, the attention of h.1 (a unit with
-- both kinds) and the root's position table. Frozen parameters must keep
-- their initial values exactly (no update, no weight decay), trainable ones
-- follow the reference (1e-5), and frozen units hold no gradient shard and
-- get no optimizer state.
--   mpirun -np 3 fsdp-lua tests/distributed/test_fsdp_frozen.lua --when=before   (or after: freeze after fsdp.shard)
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"

local opts = ... or {}
local when = opts.when or "before"
local strategy = opts.strategy or "full_shard"
local rank, world = fsdp.rank(), fsdp.world()
local TOL = 1e-5

local cfg = { vocab_size = 96, n_layer = 2, n_head = 2, n_embd = 16, block_size = 8 }
local B, T, STEPS, SEED = 12, 8, 6, 5

local function freeze(model)
  model.h:get(0):requires_grad(false)
  model.h:get(1).attn:requires_grad(false)
  -- one parameter by its tensor where there is one (materialized, or a sharded view)
  if model.wpe.weight then model.wpe.weight:requires_grad(false) else model.wpe:requires_grad(false) end
end
local function is_frozen(path) return path:match("^h%.0%.") or path:match("^h%.1%.attn%.") or path == "wpe.weight" end

local function batch(step) return t.token_batch(step * 7919 + 17, B, T, cfg.vocab_size) end
local function adamw(groups) return optim.AdamW(groups, { lr = 1e-2, betas = { 0.9, 0.95 }, eps = 1e-8 }) end

-- reference: one process, the whole batch, the same freezing
local ref = nn.GPT(cfg):materialize { seed = SEED }
freeze(ref)
local init = {}
for _, p in ipairs(ref:named_parameters()) do init[p.path] = p.tensor:view(-1):tolist() end
local ref_opt = adamw(optim.decay_groups(ref:named_parameters(), 0.1))

local model = nn.GPT(cfg)
if when == "before" then freeze(model) end
local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), strategy = strategy, seed = SEED })
if when == "after" then freeze(model) end
local opt = adamw(sharded:param_groups(0.1))

-- the layout: frozen parameters in frozen units without gradient shards
local frozen_units, trainable_numel = 0, 0
for _, u in ipairs(sharded.units) do
  for _, p in ipairs(u.params) do
    t.ok((is_frozen(p.path) and true or false) == u.frozen,
      string.format("%s is in a %s unit (%s)", p.path, u.frozen and "frozen" or "trainable", u.name))
  end
  if u.frozen then
    frozen_units = frozen_units + 1
    t.ok(u.grad == nil, "frozen unit " .. u.name .. " has no gradient shard")
  else
    trainable_numel = trainable_numel + u.numel
  end
end
t.eq(frozen_units, 3, "frozen units: h.0 (all), h.1 (attn), root (wpe)")
t.eq(sharded.units[1].name, "root", "the root's trainable unit comes first")

local per = B / world
for step = 1, STEPS do
  local x, y = batch(step)
  local _, ref_loss = ref(x, y)
  ref_loss:backward()
  ref_opt:step()
  ref_opt:zero_grad()
  local first = rank * per + 1
  local _, l = model(x:narrow(1, first, per):contiguous(), y:narrow(1, first, per):contiguous())
  l:backward()
  opt:step()
  sharded:zero_grad()
  local loss = fsdp.distributed.mean(l:item())
  local rel = math.abs(loss - ref_loss:item()) / math.abs(ref_loss:item())
  t.ok(rel <= TOL, string.format("step %d: loss %.8f vs unsharded %.8f (rel %.2g)", step, loss, ref_loss:item(), rel))
end

-- optimizer state only for trainable slices
local states, slices = 0, 0
for _ in pairs(opt.state) do states = states + 1 end
for _, s in ipairs(sharded.segments) do
  if not s.frozen then slices = slices + 1 end
end
t.eq(states, slices, string.format("rank %d: AdamW state for the %d trainable slices only", rank, slices))

local full = sharded:full_state_dict()
for _, p in ipairs(ref:named_parameters()) do
  local a, b = full[p.path]:view(-1):tolist(), p.tensor:view(-1):tolist()
  if is_frozen(p.path) then
    local same = true
    for i = 1, #a do same = same and a[i] == init[p.path][i] and b[i] == init[p.path][i] end
    t.ok(same, p.path .. ": frozen, unchanged (no update, no weight decay) in both models")
  else
    local num, den, moved = 0, 0, false
    for i = 1, #b do
      num, den = num + (a[i] - b[i]) ^ 2, den + b[i] ^ 2
      moved = moved or b[i] ~= init[p.path][i]
    end
    local rel = math.sqrt(num / math.max(den, 1e-30))
    t.ok(moved and rel <= 50 * TOL, string.format("%s: trained, relative error %.2g", p.path, rel))
  end
end

-- freezing once the optimizer holds the shards: an error at the next use, on every rank
model.h:get(1).mlp:requires_grad(false)
local x, y = batch(99)
t.raises(function() model(x:narrow(1, 1, per):contiguous(), y:narrow(1, 1, per):contiguous()) end,
  { "fsdp.shard: parameter 'h.1.mlp.c_fc.weight' was frozen after the optimizer was made",
    string.format("rank %d", rank) }, "freezing after the optimizer was made")
t.raises(function() sharded:param_groups(0.1) end, { "was frozen after the optimizer was made" },
  "and again on param_groups")

if rank == 0 then print(sharded:describe()) end
t.done()
