-- fsdp.plan: a sharded job run for real on the counting device and a
-- communicator that moves nothing. Units as fsdp.shard makes them, shards
-- and traffic against figures worked out from the units, memory falling as
-- 1/N, activation recomputation's effect, bad input, and the command line:
-- `fsdp-lua --plan --world=N --rank=r` against real runs under mpirun at
-- N = 1, 2, 4, every tag's peak equal to the byte.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local planner = require "fsdp.plan"
local shard = require "fsdp.shard"

local cfg = { vocab_size = 256, n_layer = 2, n_head = 4, n_embd = 64, block_size = 64 }
local total = nn.GPT(cfg):num_parameters()
t.eq(total, 120576, "tiny GPT parameter count")
local before = fsdp.memory.stats(nil, fsdp.default_device()).current

local function plan(world, opts, extra)
  return planner.plan(nn.GPT(cfg), opts or { policy = fsdp.policy.per_block() }, world, extra)
end

-- ---- units, shards, traffic: every N and strategy ----
local base
for _, N in ipairs({ 1, 2, 3, 4 }) do
  for _, strategy in ipairs({ "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" }) do
    local gs = strategy == "hybrid_shard" and (N % 2 == 0 and 2 or N) or nil
    local p = plan(N, { policy = fsdp.policy.per_block(), strategy = strategy, group_size = gs })
    local tag = string.format("N=%d %s", N, strategy)
    local G = strategy == "no_shard" and 1 or gs or N
    t.eq(p.group_size, G, tag .. ": shard group size")
    local au = shard.assign_units(nn.GPT(cfg), fsdp.policy.per_block())
    t.eq(#p.units, #au, tag .. ": unit count as assign_units makes them")
    local sum, padded = 0, 0
    for k, u in ipairs(p.units) do
      t.eq(u.numel, au[k].numel, tag .. ": parameters of " .. u.name)
      t.eq(u.padded, math.max(G, math.ceil(u.numel / G) * G), tag .. ": " .. u.name .. " padded to a multiple of G")
      t.eq(u.shard_numel * G, u.padded, tag .. ": shard of " .. u.name)
      sum, padded = sum + u.numel, padded + u.padded
    end
    t.eq(sum, total, tag .. ": units cover the model")
    -- traffic of a step: each unit gathered in forward, all but those kept
    -- gathered again in backward, each flat gradient reduce-scattered (f32)
    -- and, with replicas, each shard all-reduced; a shard group of one
    -- moves nothing
    local tr = p.traffic
    local root = p.units[1].padded
    local regathered = strategy == "shard_grad_op" and 0 or padded - root
    t.eq(tr.gathered_bytes, G > 1 and 4 * (padded + regathered) or 0, tag .. ": bytes all-gathered per step")
    local replicas = N / G
    local want_reduced = (G > 1 and 4 * padded or 0) + (replicas > 1 and 4 * padded / G or 0)
    t.eq(tr.reduced_bytes, want_reduced, tag .. ": bytes reduced per step")
    t.eq(tr.all_gather.calls, G > 1 and #p.units + (strategy == "shard_grad_op" and 0 or #p.units - 1) or 0,
      tag .. ": all-gathers per step")
    if N == 1 and strategy == "full_shard" then base = p end
    -- memory falls as 1/G: the persistent shards and AdamW state
    local ratio = p.persistent * G / base.persistent
    t.ok(ratio >= 0.95 and ratio <= 1.3, string.format("%s: persistent %d B x %d / %d B = %.3f", tag, p.persistent, G,
      base.persistent, ratio))
    -- (a shard group of one gathers nothing: a world of one, and no_shard, whose parameters are views of
    -- the masters)
    t.ok(p.memory.activation.peak > 0 and (p.memory.param.peak > p.memory.param.current) == (G > 1),
      tag .. (G > 1 and ": activations, and gathered buffers above the shards" or ": activations, no gathered buffers"))
  end
end

-- ---- forward prefetch (on by default) moves no more than the schedule without it ----
-- A unit the forward prefetch gathered is this forward's: its own pre_forward must not take it for a
-- stale one kept from an earlier forward and gather it again (shard_grad_op keeps every unit).
for _, strategy in ipairs({ "full_shard", "shard_grad_op", "hybrid_shard" }) do
  local per = {}
  for _, fp in ipairs({ false, true }) do
    per[fp] = plan(4, { policy = fsdp.policy.per_block(), strategy = strategy, forward_prefetch = fp,
                        group_size = strategy == "hybrid_shard" and 2 or nil }).traffic
  end
  local tag = strategy .. ", forward prefetch on and off"
  t.eq(per[true].all_gather.calls, per[false].all_gather.calls, tag .. ": the same all-gathers")
  t.eq(per[true].gathered_bytes, per[false].gathered_bytes, tag .. ": the same bytes gathered")
  t.eq(per[true].reduced_bytes, per[false].reduced_bytes, tag .. ": the same bytes reduced")
end

-- ---- exact shards for N = 4: rank 0 and rank 3 own different slices ----
do
  local p0, p3 = plan(4), plan(4, nil, { rank = 3 })
  t.eq(p0.units[1].numel, 20608, "root: wte 16384 + wpe 4096 + ln_f 128")
  t.eq(p0.units[2].numel, 49984, "a block's parameters")
  t.eq(p0.units[1].shard_numel, 5152, "root shard")
  t.eq(p3.rank, 3, "planned as rank 3")
  t.eq(p3.memory.param.current, p0.memory.param.current, "equal shards on every rank (padding included)")
  t.ok(p3.memory.optimizer.current ~= p0.memory.optimizer.current,
    "AdamW state follows the parameter slices each rank owns")
  local text = planner.format(p0)
  for _, s in ipairs({ "FSDP plan: 4 ranks, full_shard, as rank 0", "120,576 parameters in 3 units", "root h.0 h.1",
    "activation", "optimizer", "traffic of rank 0 per training step", "all-gather", "kernels per step" }) do
    t.ok(text:find(s, 1, true), "format shows '" .. s .. "'")
  end
  -- bf16 compute halves the gathered buffers, not the f32 shards; the
  -- masters' bf16 compute copies add 2 bytes per shard element to their 4
  local pb = plan(4, { policy = fsdp.policy.per_block(), mixed_precision = { compute = "bf16" } })
  t.eq(pb.memory.param.current, p0.memory.param.current * 3 / 2, "bf16: the f32 master shards and their bf16 copies")
  t.eq(pb.traffic.gathered_bytes, p0.traffic.gathered_bytes / 2, "bf16: half the bytes gathered")
  local pn = plan(4, { policy = fsdp.policy.per_block(), mixed_precision = { compute = "bf16" }, compute_copy = false })
  t.eq(pn.memory.param.current, p0.memory.param.current, "bf16 without compute copies: the same f32 master shards")
end

-- ---- activation recomputation: less activation memory, more work ----
do
  local function with(recompute)
    local m = nn.GPT(cfg)
    if recompute then nn.recompute(m, "Block") end
    return planner.plan(m, { policy = fsdp.policy.per_block() }, 2, { batch = 8 })
  end
  local plain, rec = with(false), with(true)
  t.ok(rec.memory.activation.peak < plain.memory.activation.peak, string.format(
    "recompute: activation peak %d B < %d B", rec.memory.activation.peak, plain.memory.activation.peak))
  t.ok(rec.kernels.flops > plain.kernels.flops, string.format("recompute: %.0f FLOPs per step > %.0f (the forward "
    .. "runs again)", rec.kernels.flops, plain.kernels.flops))
  t.eq(rec.memory.optimizer.peak, plain.memory.optimizer.peak, "recompute: the same optimizer state")
  -- the recomputed forward runs inside the backward walk
  local function ratio(p) return p.backward.flops / (p.kernels.flops - p.backward.flops) end
  t.ok(ratio(plain) > 1.5 and ratio(plain) < 2.5, string.format("backward / the rest = %.2f, about 2", ratio(plain)))
  t.ok(ratio(rec) > ratio(plain) + 0.5, string.format("recompute: backward / the rest = %.2f, above %.2f",
    ratio(rec), ratio(plain)))
  t.ok(planner.format(rec):find("backward ", 1, true), "format shows the backward's share")
end

-- ---- the memory-first head (head_chunk): speed-first against memory-first ----
-- The tied embedding becomes a sliced unit: gathered a chunk at a time in
-- the embedding's forward, the head's forward and its backward (3 x its
-- bytes), and reduced twice (the head's and the embedding's share, each
-- chunk as it is computed); it is never held through the blocks' backward.
do
  local N, C = 4, cfg.n_embd
  local speed = plan(N)
  local mcfg = {}
  for k, v in pairs(cfg) do mcfg[k] = v end
  mcfg.head_chunk = 40
  local mem = planner.plan(nn.GPT(mcfg), { policy = fsdp.policy.per_block() }, N)
  local wte
  for _, u in ipairs(mem.units) do if u.name == "wte.weight" then wte = u end end
  t.ok(wte ~= nil, "head_chunk: wte.weight is a unit of its own")
  t.eq(wte and wte.numel, cfg.vocab_size * C, "head_chunk: the sliced unit holds the table")
  t.eq(wte and wte.padded % (N * C), 0, "head_chunk: every shard holds whole rows")
  local root, blocks = mem.units[1].padded, 0
  for _, u in ipairs(mem.units) do if u ~= mem.units[1] and u ~= wte then blocks = blocks + u.padded end end
  t.eq(mem.traffic.gathered_bytes, 4 * (root + 2 * blocks + 3 * wte.padded), "head_chunk: bytes all-gathered per step")
  t.eq(mem.traffic.reduced_bytes, 4 * (root + blocks + 2 * wte.padded), "head_chunk: bytes reduced per step")
  t.ok(mem.traffic.gathered_bytes > speed.traffic.gathered_bytes, "head_chunk: more traffic than speed-first")
  t.ok(mem.peak < speed.peak, string.format("head_chunk: param + grad + optimizer peak %d B < %d B (speed-first)",
    mem.peak, speed.peak))
  t.ok(mem.memory.activation.peak < speed.memory.activation.peak, string.format(
    "head_chunk: activation peak %d B < %d B (no whole logits)", mem.memory.activation.peak,
    speed.memory.activation.peak))
  local ratio = mem.persistent / speed.persistent
  t.ok(ratio > 0.98 and ratio < 1.02, string.format("head_chunk: the same persistent shards (ratio %.4f)", ratio))
end

-- ---- bad input ----
t.raises(function() plan(2, { policy = function() return 1 end }) end,
  { "wrap policy returned 1", "expected true or false" }, "a policy returning a number")
t.raises(function() plan(3, { strategy = "hybrid_shard", group_size = 2 }) end,
  { "group_size 2 does not divide the world size 3" }, "hybrid group size not dividing the world")
t.raises(function() plan(0) end, { "world size must be a positive integer" }, "world 0")
t.raises(function() plan(2, nil, { rank = 2 }) end, { "rank must be a whole number in 0..1" }, "rank outside the world")
t.raises(function() planner.plan("model", {}, 2) end, { "expected an nn module" }, "not a module")
t.raises(function() plan(2, nil, { batch = 3 }) end, { "batch 3 is not divisible by 2 ranks" }, "batch")

-- ---- dryrun.deterministic: dead handles go back at fixed points only ----
-- The collector stays stopped through the full collections the library
-- makes (fsdp.collect, a recomputed block's forward and backward), so Lua
-- garbage, which differs between a plan and a real run, cannot move a
-- tag's peak. (LuaJIT's full collection restarts a stopped collector: its
-- steps then freed dead activations earlier in one run than in another,
-- a real run now and then 16 KiB above its plan.)
do
  local sink
  local function peaks(garbage)
    local device = fsdp.default_device()
    fsdp.collect()
    fsdp.memory.empty_cache(device)
    local base = fsdp.memory.all(device)
    fsdp.memory.reset_peak(device)
    local now, running
    require("fsdp.dryrun").deterministic(function()
      local c = { vocab_size = 256, n_layer = 2, n_head = 4, n_embd = 64, block_size = 32 }
      local model = nn.GPT(c)
      nn.recompute(model, "Block")
      local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 5 })
      local opt = require("fsdp.optim").AdamW(sharded:param_groups(0.1), { lr = 1e-3 })
      for step = 1, 2 do
        local x, y = t.token_batch(step, 2, 32, c.vocab_size)
        local _, loss = model(x, y)
        for i = 1, garbage do sink = { i } end   -- Lua garbage, no tensors
        loss:backward()
        opt:step()
        sharded:zero_grad()
      end
      fsdp.collect()
      running = collectgarbage("isrunning")
      now = fsdp.memory.all(device)
    end)
    local p = {}
    for _, tag in ipairs(fsdp.memory.tags) do p[tag] = now[tag].peak - base[tag].current end
    return p, running
  end
  local quiet, running = peaks(0)
  local noisy = peaks(300000)
  t.eq(running, false, "deterministic: the collector is still stopped after the library's full collections")
  for _, tag in ipairs(fsdp.memory.tags) do
    t.eq(noisy[tag], quiet[tag], "deterministic: Lua garbage leaves the " .. tag .. " peak as it was")
  end
  t.ok(collectgarbage("isrunning"), "deterministic: the collector runs again afterwards")
end

-- planning left the engine's memory as it was (everything went to the counting device)
collectgarbage()
t.eq(fsdp.memory.stats(nil, fsdp.default_device()).current, before, "the planner leaves no memory behind")

-- ---- the command line ----
local launcher = os.getenv("FSDP_TEST_LAUNCHER")
local mpirun = os.getenv("FSDP_TEST_MPIRUN")
if not launcher then
  io.stderr:write("FSDP_TEST_LAUNCHER is not set: skipping the --plan command line checks\n")
else
  local function run(cmd)
    local f = io.popen(cmd .. " 2>&1; echo \"exit=$?\"")
    local out = f:read("*a")
    f:close()
    return out, tonumber(out:match("exit=(%d+)%s*$"))
  end
  local out, code = run(launcher .. " --plan --world=8 recipes/gpt2.lua --preset=small")
  t.eq(code, 0, "--plan --world=8 recipes/gpt2.lua --preset=small exits 0")
  t.ok(out:find("FSDP plan: 8 ranks, full_shard, as rank 0", 1, true), "--plan prints the plan header")
  t.ok(out:find("124,475,904 parameters", 1, true), "--plan: GPT-2 small's parameter count")
  out, code = run(launcher .. " --plan --world=3 recipes/gpt2.lua --preset=tiny --batch=6 --strategy=hybrid_shard "
    .. "--group-size=2")
  t.ok(code ~= 0 and out:find("does not divide the world size 3", 1, true),
    "--plan reports a group size that does not divide --world")
  out, code = run(launcher .. " --world=4 recipes/gpt2.lua")
  t.ok(code ~= 0 and out:find("--world=N only applies with --plan", 1, true), "--world without --plan")
  out, code = run(launcher .. " --plan --world=two recipes/gpt2.lua")
  t.ok(code ~= 0 and out:find("--world expects a positive whole number", 1, true), "--world=two")
  out, code = run(launcher .. " --plan --world=2 --rank=2 recipes/gpt2.lua")
  t.ok(code ~= 0 and out:find("--rank=2 is not a rank of --world=2", 1, true), "--rank outside --world")
  -- a GPU job planned anywhere: the CUDA kernel set, shards offloaded to the host
  out, code = run(launcher .. " --plan --device=cuda --world=2 recipes/gpt2.lua --preset=tiny --offload")
  if out:find("CUDA kernel table is not built", 1, true) then
    t.ok(code ~= 0, "--device=cuda without the CUDA table says so")
  else
    t.eq(code, 0, "--plan --device=cuda exits 0")
    t.ok(out:find("the cuda kernel set", 1, true), "--device=cuda: the CUDA kernel set")
    t.ok(out:find("\n  optimizer +0.00 +0.00 +0 ", 1) ~= nil, "--offload: no optimizer state on the GPU")
    t.ok(out:find("host (offload): param", 1, true), "--offload: shards and state in host memory")
  end
  out, code = run(launcher .. " --plan --device=gpu recipes/gpt2.lua")
  t.ok(code ~= 0 and out:find("--device expects cpu or cuda", 1, true), "--device=gpu")
  out, code = run(launcher .. " --device=cpu recipes/gpt2.lua")
  t.ok(code ~= 0 and out:find("--device=D only applies with --plan", 1, true), "--device without --plan")
  out, code = run(launcher .. " --help")
  t.ok(code == 0 and out:find("--plan", 1, true) and out:find("--rank=R", 1, true), "--help documents them")

  -- --plan against real runs: tests/lua/plan_job.lua prints every tag's
  -- peak per rank; the plan of each rank must hold the same bytes
  local function plan_peaks(N, r, args)
    local o = run(string.format("%s --plan --world=%d --rank=%d tests/lua/plan_job.lua %s", launcher, N, r, args))
    local peaks = {}
    for _, tag in ipairs(fsdp.memory.tags) do peaks[tag] = tonumber(o:match("\n  " .. tag .. " +[%d.]+ +[%d.]+ +(%d+)")) end
    return peaks, o
  end
  if not mpirun then
    io.stderr:write("FSDP_TEST_MPIRUN is not set: skipping the comparison with real runs\n")
  else
    for _, case in ipairs({ { 1, "" }, { 2, "" }, { 4, "" }, { 4, "--strategy=hybrid_shard --group-size=2" },
      { 2, "--compute=bf16 --recompute" }, { 2, "--compress=int8" }, { 3, "--compress=topk --compute=bf16" } }) do
      local N, args = case[1], case[2]
      local real_cmd = string.format("FSDP_COMM_SYNC=1 %s %d %s tests/lua/plan_job.lua %s", mpirun, N, launcher, args)
      local real = run(real_cmd)
      local plans = {}
      for r = 0, N - 1 do plans[r] = { plan_peaks(N, r, args) } end
      for r = 0, N - 1 do
        local peaks, o = plans[r][1], plans[r][2]
        for _, tag in ipairs(fsdp.memory.tags) do
          local want = tonumber(real:match("rank " .. r .. " " .. tag .. " peak (%d+)"))
          t.ok(want ~= nil and peaks[tag] == want, string.format("N=%d %s rank %d: %s peak, --plan %s = real %s", N,
            args, r, tag, tostring(peaks[tag]), tostring(want)) .. (want and peaks[tag] and "" or "\n" .. real .. o))
        end
      end
    end

    -- the recipe itself: its --metrics peaks per tag (the largest rank's,
    -- the largest step's) against `--plan` without --rank. At N = 4 rank 3
    -- holds 1.5 KiB more AdamW state than rank 0 (its slices round
    -- differently); at N = 2 the first step once held the MFU probe's dead
    -- matmul tensors under the activation tag.
    local json, metrics = require "fsdp.json", require "fsdp.metrics"
    local recipe_args = "recipes/gpt2.lua --preset=tiny --steps=2 --sample=0 --eval-every=0"
    for _, N in ipairs({ 2, 4 }) do
      local path = os.tmpname()
      local real = run(string.format("FSDP_COMM_SYNC=1 %s %d %s %s --metrics=%s", mpirun, N, launcher, recipe_args,
        path))
      local want, steps = {}, 0
      for line in io.lines(path) do
        local rec = json.decode(line)
        if rec.peak_bytes then
          steps = steps + 1
          for _, tag in ipairs(metrics.TAGS) do want[tag] = math.max(want[tag] or 0, rec.peak_bytes[tag]) end
        end
      end
      os.remove(path)
      t.eq(steps, 2, string.format("recipe N=%d: two steps in --metrics", N) .. (steps == 2 and "" or "\n" .. real))
      local o = run(string.format("%s --plan --world=%d %s", launcher, N, recipe_args))
      t.ok(o:find("the largest of the " .. N .. " ranks", 1, true), string.format("recipe N=%d: --plan reports "
        .. "the largest rank's memory", N))
      for _, tag in ipairs(metrics.TAGS) do   -- (every tag but "other")
        local planned = tonumber(o:match("\n  " .. tag .. " +[%d.]+ +[%d.]+ +(%d+)"))
        t.ok(planned ~= nil and planned == want[tag], string.format("recipe N=%d: %s peak, --plan %s = real %s", N,
          tag, tostring(planned), tostring(want[tag])) .. (planned and "" or "\n" .. o))
      end
    end
  end
end
t.done()
