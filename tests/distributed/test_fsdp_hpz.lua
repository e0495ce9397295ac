-- reshard_after_forward as a group size (ZeRO++ hpZ): a forward gathers
-- each unit from the whole shard group and keeps this rank's 1/G of it for
-- the backward, which regathers within groups of G ranks. It changes where
-- the backward's gather comes from, never what is computed: losses,
-- gradient shards and parameters after three AdamW steps equal the default
-- schedule's (1e-6). The planner shows its cost: the kept parts in the
-- param peak, the same bytes gathered (G > 1), or half of them (G = 1: no
-- gather in backward).
--   mpirun -np 4 fsdp-lua tests/distributed/test_fsdp_hpz.lua
-- Options: --strategy=hybrid_shard --group-size=G, --recompute (activation recomputation of the blocks)
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local planner = require "fsdp.plan"
local dist = fsdp.distributed

local opts = ... or {}
local rank, world = dist.rank(), dist.world()
local cfg = { vocab_size = 97, n_layer = 3, n_head = 3, n_embd = 21, block_size = 8 }
local B, T, STEPS = 2, 8, 3
local strategy = opts.strategy or "full_shard"
local group_size = opts.group_size   -- hybrid_shard's

local function batch(step) return t.token_batch(step * 7919 + rank * 104729 + 17, B, T, cfg.vocab_size) end

local function train(raf, steps, compute)
  local model = nn.GPT(cfg)
  if opts.recompute then nn.recompute(model, "Block") end
  local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 7, strategy = strategy,
    group_size = group_size, reshard_after_forward = raf, mixed_precision = { compute = compute or "f32" } })
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 3e-3, betas = { 0.9, 0.95 } })
  local run = t.train_sharded(model, sharded, opt, batch, steps or STEPS)
  -- an evaluation forward (no backward) keeps nothing behind
  fsdp.no_grad(function() model(batch(99)) end)
  return run
end

local worst_diff = t.max_abs_diff

local N = strategy == "hybrid_shard" and group_size or world
local sizes = {}
for G = 1, N do if N % G == 0 then sizes[#sizes + 1] = G end end
for _, compute in ipairs({ "f32", "bf16" }) do
  local ref = train(true, nil, compute)
  for _, G in ipairs(sizes) do
    local got = train(G, nil, compute)
    local dl = 0
    for s = 1, STEPS do dl = math.max(dl, math.abs(got.losses[s] - ref.losses[s])) end
    local dg, dp = worst_diff(got.grads, ref.grads), worst_diff(got.params, ref.params)
    t.ok(dl <= 1e-6 and dg <= 1e-6 and dp <= 1e-6, string.format("rank %d of %d (%s, %s): reshard_after_forward = %d: "
      .. "losses, gradient shards and parameters equal the default's (max diff %.3g, %.3g, %.3g)", rank, world,
      strategy, compute, G, dl, dg, dp))
  end
end

-- A forward with grad whose backward never comes keeps each unit's part;
-- an optimizer step then changes the masters. The next forward's prefetch
-- (and each unit's gather) must come from the new masters, not the stale
-- parts: its loss, and the parameters after its step, equal the default's.
local function stale_parts(raf)
  local model = nn.GPT(cfg)
  local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 7, strategy = strategy,
    group_size = group_size, reshard_after_forward = raf, forward_prefetch = true })
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 3e-3, betas = { 0.9, 0.95 } })
  local x, y = batch(1)
  local _, loss = model(x, y)
  loss:backward()
  opt:step()
  sharded:zero_grad()
  model(batch(2))   -- grad enabled, no backward: the parts stay
  opt:step()        -- the masters move (momentum, weight decay)
  x, y = batch(3)
  _, loss = model(x, y)
  loss:backward()
  local l = dist.mean(loss:item())
  opt:step()
  local params = {}
  for i, u in ipairs(sharded.units) do params[i] = u.master:tolist() end
  fsdp.tape_clear()
  return l, params
end
do
  local ref_loss, ref_params = stale_parts(true)
  for _, G in ipairs(sizes) do
    local l, params = stale_parts(G)
    local dp = worst_diff(params, ref_params)
    t.ok(math.abs(l - ref_loss) <= 1e-6 and dp <= 1e-6, string.format("rank %d (%s): reshard_after_forward = %d, "
      .. "an optimizer step after a forward without backward: the next loss %.9g (default %.9g) and parameters "
      .. "(max diff %.3g) equal the default's", rank, strategy, G, l, ref_loss, dp))
  end
end

-- the planner: the kept parts and the traffic
local function plan(raf) return planner.run(function() train(raf, 2) end, { world = world, rank = rank }) end
local pd = plan(true)
local kept_units = 0   -- elements of the units freed after forward (the blocks)
for _, u in ipairs(pd.units) do if u.name ~= "root" then kept_units = kept_units + u.padded end end
for _, G in ipairs(sizes) do
  if G < N then
    local p = plan(G)
    local extra = p.memory.param.peak - pd.memory.param.peak
    dist.print0("%s on %d ranks, reshard_after_forward = %d: planned param peak %d B (default %d B), gathered %d B "
      .. "per step (default %d B)", strategy, world, G, p.memory.param.peak, pd.memory.param.peak,
      p.traffic.gathered_bytes, pd.traffic.gathered_bytes)
    t.ok(extra >= 4 * kept_units / G * 0.5 and extra <= 4 * kept_units / G * 1.3 + 4096, string.format("rank %d: G = %d "
      .. "holds the blocks' kept parts (%d B more at the peak; 4 x %d / %d = %d B)", rank, G, extra, kept_units, G,
      4 * kept_units / G))
    if G > 1 then
      t.eq(p.traffic.gathered_bytes, pd.traffic.gathered_bytes, string.format("G = %d gathers the same bytes", G))
    else
      t.ok(p.traffic.gathered_bytes < pd.traffic.gathered_bytes, string.format("G = 1 gathers less (%d B against "
        .. "%d B): no gather in backward", p.traffic.gathered_bytes, pd.traffic.gathered_bytes))
    end
  end
end

-- bad input
t.raises(function() fsdp.shard(nn.GPT(cfg), { reshard_after_forward = 0 }) end,
  { "reshard_after_forward must be true, false or a group size", "got 0", "rank " .. rank }, "a group size of 0")
t.raises(function() fsdp.shard(nn.GPT(cfg), { reshard_after_forward = 2, strategy = "shard_grad_op" }) end,
  { "applies to full_shard and hybrid_shard, not shard_grad_op" }, "with shard_grad_op")
if world > 1 then
  t.raises(function() fsdp.shard(nn.GPT(cfg), { reshard_after_forward = world + 1 }) end,
    { "group size " .. (world + 1) .. " does not divide the shard group of " .. world .. " ranks" },
    "a group size that does not divide the shard group")
end
t.done()
