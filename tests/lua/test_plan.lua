-- fsdp.plan on the tiny GPT (one process, nothing allocated): units and
-- parameter counts as assign_units makes them, padding and shards for
-- N in {1, 2, 3, 4, 8} and every strategy, the allocator rounding, memory
-- falling as 1/N, traffic counts, wrap policies, bad options, and
-- `fsdp-lua --plan --world=4 recipes/gpt2.lua --preset=small`.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local planner = require "fsdp.plan"
local shard = require "fsdp.shard"

local cfg = { vocab_size = 256, n_layer = 2, n_head = 4, n_embd = 64, block_size = 64 }
local model = nn.GPT(cfg)
local total = model:num_parameters()
t.eq(total, 120576, "tiny GPT parameter count")
local before = fsdp.memory.stats().current

-- ---- the allocator's rounding ----
local R = planner.round
t.eq(R(1), 64, "round 1 B")
t.eq(R(64), 64, "round 64 B")
t.eq(R(65), 128, "round 65 B")
t.eq(R(4096), 4096, "round 4 KiB")
t.eq(R(4097), 5120, "round 4 KiB + 1: a quarter step of 4 KiB")
t.eq(R(8192), 8192, "round 8 KiB")
t.eq(R(8193), 10240, "round 8 KiB + 1")
t.eq(R(12288), 12288, "round 12 KiB")
t.eq(R(12289), 14336, "round 12 KiB + 1")
t.eq(R(49984), 57344, "round 49984 B (a tiny block's f32 shard on 4 ranks)")
t.eq(R(2 ^ 20 + 1), 2 ^ 20 + 2 ^ 18, "round 1 MiB + 1")

-- ---- every N and strategy ----
local function paths(units)
  local ps = {}
  for _, u in ipairs(units) do ps[#ps + 1] = u.path end
  return table.concat(ps, " ")
end
local strategies = { "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" }
local base                                   -- full_shard at N = 1
for _, N in ipairs({ 1, 2, 3, 4, 8 }) do
  for _, strategy in ipairs(strategies) do
    local gs = strategy == "hybrid_shard" and (N % 2 == 0 and 2 or N) or nil
    local opts = { policy = fsdp.policy.per_block(), strategy = strategy, group_size = gs }
    local p = planner.plan(model, opts, N)
    local tag = string.format("N=%d %s", N, strategy)
    local G = strategy == "no_shard" and 1 or gs or N
    t.eq(p.group_size, G, tag .. ": shard group size")
    t.eq(p.replicas, N / G, tag .. ": replicas")
    -- units and counts as assign_units makes them
    local au = shard.assign_units(model, opts.policy)
    t.eq(#p.units, #au, tag .. ": unit count")
    t.eq(paths(p.units), paths(au), tag .. ": unit paths")
    local sum, shards = 0, 0
    for k, u in ipairs(p.units) do
      t.eq(u.numel, au[k].numel, tag .. ": params of " .. u.name)
      t.eq(u.tensors, #au[k].params, tag .. ": tensors of " .. u.name)
      t.eq(u.bytes_f32, 4 * u.numel, tag .. ": f32 bytes of " .. u.name)
      t.ok(u.padded % G == 0 and u.padded >= u.numel and u.padded - u.numel < G and u.padded >= G,
        tag .. ": padding of " .. u.name)
      t.eq(u.shard_numel * G, u.padded, tag .. ": shard of " .. u.name)
      sum = sum + u.numel
      shards = shards + u.shard_numel
    end
    t.eq(sum, total, tag .. ": units cover the model")
    t.eq(p.numel, total, tag .. ": plan total")
    t.ok(shards * G >= total, tag .. ": shards times G hold at least the model")
    -- every element is owned by exactly one shard index
    local owned = 0
    for _, r in ipairs(p.ranks) do owned = owned + r.owned_numel end
    t.eq(owned, total, tag .. ": shards own every element once")
    t.eq(#p.ranks, G, tag .. ": one prediction per shard index")
    for _, r in ipairs(p.ranks) do
      t.eq(r.persistent, r.param.persistent + r.grad.persistent + r.optimizer.persistent, tag .. ": persistent sum")
      t.eq(r.peak, r.param.peak + r.grad.peak + r.optimizer.peak, tag .. ": peak sum")
      t.ok(r.param.peak > r.param.persistent and r.grad.peak > r.grad.persistent,
        tag .. ": gathered buffers above the shards")
    end
    if N == 1 and strategy == "full_shard" then base = p end
    -- memory falls as 1/G: rounding adds at most a few tenths
    local ratio = p.max.persistent * G / base.max.persistent
    t.ok(ratio >= 0.95 and ratio <= 1.25, string.format("%s: persistent %d B x %d / %d B = %.3f", tag,
      p.max.persistent, G, base.max.persistent, ratio))
    t.eq(p.unsharded.total, base.unsharded.total, tag .. ": the unsharded figure does not depend on N")
    -- traffic
    local tr, padded, shard_n = p.traffic, 0, 0
    for _, u in ipairs(p.units) do
      padded = padded + u.padded
      shard_n = shard_n + u.shard_numel
    end
    t.eq(tr.gathers_forward, 3, tag .. ": one forward gather per unit")
    t.eq(tr.gathers_backward, strategy == "shard_grad_op" and 0 or 2, tag .. ": backward gathers")
    local gathered_units = padded + (strategy == "shard_grad_op" and 0 or padded - p.units[1].padded)
    t.eq(tr.gather_bytes, 4 * gathered_units, tag .. ": gathered bytes")
    t.eq(tr.gather_network_bytes, G > 1 and 4 * gathered_units or 0, tag .. ": gathered bytes on the network")
    t.eq(tr.reduce_scatter_bytes, 4 * padded, tag .. ": reduce-scatter bytes")
    t.eq(tr.all_reduces, N / G > 1 and 3 or 0, tag .. ": all-reduces")
    t.eq(tr.all_reduce_bytes, N / G > 1 and 4 * shard_n or 0, tag .. ": all-reduce bytes")
    -- the root stays gathered; the limit (2) lets both blocks be gathered with it
    t.eq(p.peak_gathered, 3, tag .. ": units gathered at once")
  end
end

-- ---- exact figures for N = 4, full_shard, per block ----
do
  local p = planner.plan(model, { policy = fsdp.policy.per_block() }, 4)
  local root, blk = p.units[1], p.units[2]
  t.eq(root.numel, 20608, "root: wte 16384 + wpe 4096 + ln_f 128")
  t.eq(blk.numel, 49984, "a block's parameters")
  t.eq(root.shard_numel, 5152, "root shard")
  t.eq(blk.shard_numel, 12496, "block shard")
  -- masters: R(4*5152) + 2 R(4*12496) = 24576 + 2*57344
  t.eq(p.rank0.param.persistent, 139264, "master shards, rounded")
  t.eq(p.rank0.grad.persistent, 139264, "gradient shards, rounded")
  -- peak: masters + root's full buffer R(82432) + both blocks' R(199936)
  -- (one running, one prefetched: the limit of 2 leaves the root out)
  t.eq(p.rank0.param.peak, 139264 + 98304 + 2 * 229376, "param peak: root and both blocks gathered")
  -- the root's flat gradient, one block's, and the one still reduce-scattering
  t.eq(p.rank0.grad.peak, 139264 + 98304 + 2 * 229376, "grad peak: root's and two blocks' flat gradients")
  t.eq(p.rank0.comm.peak, 24576 + 2 * 57344, "comm peak: every reduce-scatter output")
  -- rank 0 owns wte rows 0..80 (5152 = 80.5 rows of 64): AdamW state is
  -- 2 x R(4 * 5152) for the root, and per block the slices it owns
  t.ok(p.rank0.optimizer.persistent >= 8 * p.rank0.owned_numel, "AdamW: at least 8 B per owned element")
  local want = 0
  for _, u in ipairs(p.units) do
    local off = 0
    for _, q in ipairs(u.params) do
      local len = math.min(u.shard_numel, off + q.numel) - math.max(0, off)
      if len > 0 then want = want + 2 * R(4 * len) end
      off = off + q.numel
    end
  end
  t.eq(p.rank0.optimizer.persistent, want, "AdamW state of rank 0, slice by slice")
  t.eq(planner.for_rank(p, 2), p.ranks[3], "for_rank picks the shard index")
  -- bf16 compute halves the gathered buffers, not the shards
  local pb = planner.plan(model, { policy = fsdp.policy.per_block(), mixed_precision = { compute = "bf16" } }, 4)
  t.eq(pb.rank0.param.persistent, p.rank0.param.persistent, "bf16: same f32 masters")
  t.eq(pb.units[2].full_bytes, R(2 * 49984), "bf16: a block's full buffer")
  t.eq(pb.traffic.gather_bytes, p.traffic.gather_bytes / 2, "bf16: half the gathered bytes")
  t.eq(pb.traffic.reduce_scatter_bytes, p.traffic.reduce_scatter_bytes / 2, "bf16 reduce follows compute")
  -- the unsharded model: 16 B per element, rounded per tensor
  local un = 0
  for _, q in ipairs(model:named_parameters()) do
    local n = 1
    for _, s in ipairs(q.shape) do n = n * s end
    un = un + 4 * R(4 * n)
  end
  t.eq(p.unsharded.total, un, "unsharded param + grad + AdamW")
  local text = planner.format(p)
  for _, s in ipairs({ "FSDP plan: 4 ranks, full_shard", "120,576 parameters", "root*", "h.0", "h.1",
    "memory per rank", "param + grad + optimizer, peak", "unsharded model", "traffic per training step",
    "all-gather     3 forward + 2 backward gathers" }) do
    t.ok(text:find(s, 1, true), "format shows '" .. s .. "'")
  end
end

-- ---- policies ----
local function plan_paths(policy, N)
  local p = planner.plan(model, { policy = policy }, N or 2)
  local ps = {}
  for _, k in ipairs(p.order) do ps[#ps + 1] = p.units[k].name end
  return table.concat(ps, " "), p
end
t.eq(plan_paths(fsdp.policy.per_block()), "root h.0 h.1", "per block: root, h.0 .. h.{L-1}")
t.eq(plan_paths(fsdp.policy.none()), "root", "none: the root only")
t.eq(plan_paths(nil), "root", "no policy: the root only")
t.eq(plan_paths(fsdp.policy.by_size(100000)), "root", "by_size above every module: root only")
-- both blocks together hold 99968 parameters, but only in their list, a
-- module without a forward of its own: nothing would gather it, so it is
-- never a unit
t.eq(plan_paths(fsdp.policy.by_size(99968)), "root", "by_size 99968: the block list is not a unit")
-- 30000: each MLP (33088); what the blocks keep (2 x 16896) stays with the root
t.eq(plan_paths(fsdp.policy.by_size(30000)), "root h.0.mlp h.1.mlp", "by_size 30000")
do
  local _, p = plan_paths(fsdp.policy.by_size(30000))
  t.eq(#p.warnings, 0, "by_size 30000: no warning")
end
-- 10000: the big Linears (c_attn 12480, c_fc 16640, c_proj 16448); the tied
-- embedding (16384) stays with the root
t.eq(plan_paths(fsdp.policy.by_size(10000)),
  "root h.0.attn.c_attn h.0.mlp.c_fc h.0.mlp.c_proj h.1.attn.c_attn h.1.mlp.c_fc h.1.mlp.c_proj", "by_size 10000")
do
  local custom = function(m, path) return path == "h.1" or m.__name == "MLP" end
  local names, p = plan_paths(custom, 4)
  t.eq(names, "root h.0.mlp h.1 h.1.mlp", "custom: h.1 and every MLP, nested in execution order")
  local byname = {}
  for _, u in ipairs(p.units) do byname[u.name] = u end
  t.eq(byname["h.1.mlp"].depth, 2, "h.1.mlp runs inside h.1")
  t.eq(p.units[byname["h.1.mlp"].parent].name, "h.1", "h.1.mlp's enclosing unit")
  t.eq(byname["h.1"].numel, 49984 - 33088, "h.1 keeps what its MLP did not claim")
  t.eq(p.peak_gathered, 3, "root, h.1 and h.1.mlp gathered at once")
end
-- a per-type policy by name
t.eq(plan_paths(fsdp.policy.by_type("CausalSelfAttention")), "root h.0.attn h.1.attn", "by_type attention")

-- ---- bad input ----
t.raises(function() planner.plan(model, { policy = function() return 1 end }, 2) end,
  { "wrap policy returned 1", "expected true or false" }, "a policy returning a number")
t.raises(function() planner.plan(model, { strategy = "hybrid_shard", group_size = 2 }, 3) end,
  { "group_size 2 does not divide the world size 3" }, "hybrid group size not dividing the world")
t.raises(function() planner.plan(model, { strategy = "hybrid_shard" }, 4) end, { "needs group_size" },
  "hybrid without a group size")
t.raises(function() planner.plan(model, { strategy = "zero3" }, 4) end, { "unknown strategy 'zero3'" },
  "an unknown strategy")
t.raises(function() planner.plan(model, {}, 0) end, { "world size must be a positive integer" }, "world 0")
t.raises(function() planner.plan(model, { mixed_precision = { compute = "f16" } }, 2) end, { "f32 or bf16" },
  "an unknown compute dtype")

-- planning allocated nothing
t.eq(fsdp.memory.stats().current, before, "the planner allocates no engine memory")

-- ---- the command line ----
local launcher = os.getenv("FSDP_TEST_LAUNCHER")
if not launcher then
  io.stderr:write("FSDP_TEST_LAUNCHER is not set: skipping the --plan command line checks\n")
else
  local function run(args)
    local f = io.popen(string.format("%s %s 2>&1; echo \"exit=$?\"", launcher, args))
    local out = f:read("*a")
    f:close()
    local code = tonumber(out:match("exit=(%d+)%s*$"))
    return out, code
  end
  local out, code = run("--plan --world=4 recipes/gpt2.lua --preset=small")
  t.eq(code, 0, "--plan --world=4 recipes/gpt2.lua --preset=small exits 0")
  t.ok(out:find("FSDP plan: 4 ranks, full_shard", 1, true), "--plan prints the plan header")
  t.ok(out:find("124,475,904 parameters", 1, true), "--plan: GPT-2 small's parameter count")
  t.ok(not out:find("| loss", 1, true), "--plan trains no step")
  -- the printed memory lines are the planner's own for that model
  local small = nn.GPT({ vocab_size = 50257, n_layer = 12, n_head = 12, n_embd = 768, block_size = 1024 })
  local p = planner.plan(small, { policy = fsdp.policy.per_block() }, 4)
  local line = planner.format(p):match("\n(  param %+ grad %+ optimizer, peak[^\n]*)")
  t.ok(line and out:find(line, 1, true), "--plan's peak line equals the planner's: " .. tostring(line))
  out, code = run("--plan --world=3 recipes/gpt2.lua --preset=tiny --batch=6 --strategy=hybrid_shard --group-size=2")
  t.ok(code ~= 0 and out:find("does not divide the world size 3", 1, true),
    "--plan reports a group size that does not divide --world")
  out, code = run("--world=4 recipes/gpt2.lua")
  t.ok(code ~= 0 and out:find("--world=N only applies with --plan", 1, true), "--world without --plan")
  out, code = run("--plan --world=two recipes/gpt2.lua")
  t.ok(code ~= 0 and out:find("--world expects a positive whole number", 1, true), "--world=two")
  out, code = run("--help")
  t.ok(code == 0 and out:find("--plan", 1, true) and out:find("--world=N", 1, true), "--help documents them")
end
t.done()
