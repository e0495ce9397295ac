-- wrap_policies.lua: which wrap policy suits a GPT on N ranks? For each
-- policy in the table below it prints the planner's prediction (units,
-- memory per rank and tag, traffic per step) and, under mpirun with more
-- than one rank or with --measure, trains a few steps sharded with that
-- policy and prints what happened next to what was predicted.
--
--   fsdp-lua recipes/wrap_policies.lua                          # plans only (one rank)
--   fsdp-lua recipes/wrap_policies.lua --measure --steps=3      # plans, and measures on one rank
--   mpirun -np 4 fsdp-lua recipes/wrap_policies.lua             # plans for 4 ranks, measures on 4
--   mpirun -np 4 fsdp-lua recipes/wrap_policies.lua --policy=custom --verbose
--   fsdp-lua recipes/wrap_policies.lua --world=64 --preset=small   # plan a job you do not have ranks for
--
-- To try a policy: edit `policies` (the custom one is there for that), rerun.
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local options = require "fsdp.options"
local planner = require "fsdp.plan"
local dist = fsdp.distributed
local now = require("fsdp.timer").now

local o = options.parse(..., {
  { "preset", { "tiny", "small" }, "tiny", "model: tiny (2 layers, width 64) or small (GPT-2 124M)" },
  { "policy", "string", nil, "only this policy (a name from the table)" },
  { "min_params", "int", nil, "the by-size threshold (default: tiny 16000, small 5000000)", min = 1 },
  { "strategy", { "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" }, "full_shard", "sharding strategy" },
  { "group_size", "int", nil, "hybrid_shard: ranks per shard group", min = 1 },
  { "dtype", { "f32", "bf16" }, "f32", "compute dtype of gathered parameters" },
  { "limit", "int", 2, "units gathered at once (prefetch limit)", min = 1 },
  { "world", "int", nil, "plan for this many ranks (default: the ranks running; measuring needs the real ones)", min = 1 },
  { "measure", "bool", false, "train and measure even on one rank" },
  { "steps", "int", 3, "measured training steps per policy (after one warm-up step)", min = 1 },
  { "batch", "int", 8, "sequences per global batch (divisible by the ranks)", min = 1 },
  { "ctx", "int", 64, "tokens per sequence", min = 1 },
  { "verbose", "bool", false, "print the planner's full report per policy" },
  { "check", "bool", false, "exit 1 unless the measured memory and traffic are within 10% of the plan" },
  { "threads", "int", nil, "CPU threads per rank", min = 1, max = 256 },
}, "wrap_policies.lua")
if o.threads then fsdp.set_num_threads(o.threads) end

local cfg = nn.gpt_preset(o.preset)
-- (tiny: the big Linears and each attention; small: each block. Between
-- 16897 and 33792 on tiny the block list `h` itself qualifies: a ModuleList,
-- whose forward nobody calls, so the planner warns and training fails.)
local min_params = o.min_params or (o.preset == "tiny" and 16000 or 5000000)

-- ---- the policies: edit, add, rerun ----
-- A policy is function(module, path, unclaimed) -> true to make `module` a
-- unit. Children are asked first; `unclaimed` counts the parameters under
-- `module` that no unit below it took. The root unit gets what is left.
local policies = {
  { name = "block", about = "one unit per transformer block", policy = fsdp.policy.per_block() },
  { name = "size", about = string.format("a unit at every module holding >= %d unclaimed parameters", min_params),
    policy = fsdp.policy.by_size(min_params) },
  { name = "none", about = "the root only: the whole model is one unit", policy = fsdp.policy.none() },
  { name = "custom", about = "attention and MLP of every block as units of their own",
    policy = function(module, path, unclaimed)
      return module.__name == "CausalSelfAttention" or module.__name == "MLP"
    end },
}

local rank, ranks = dist.rank(), dist.world()
local world = o.world or ranks
local measure = ranks > 1 or o.measure
if measure and world ~= ranks then
  options.fail("wrap_policies.lua: --world=%d but %d rank(s) run: measuring needs the real ranks (drop "
    .. "--world or --measure)", world, ranks)
end
if measure and o.batch % ranks ~= 0 then
  options.fail("wrap_policies.lua: --batch=%d is not divisible by %d ranks", o.batch, ranks)
end
local function say(...) if rank == 0 then print(string.format(...)) end end
local function mib(b) return b and string.format("%.2f", b / 2 ^ 20) or "-" end

local function shard_opts(entry)
  return { policy = entry.policy, strategy = o.strategy, group_size = o.group_size, limit = o.limit, seed = 1,
    mixed_precision = { compute = o.dtype, reduce = "f32" } }
end

-- this rank's rows of a fixed global batch (random tokens; the loss is
-- not the point here)
local function batch()
  local rows, targets, x = {}, {}, 12345
  local mine = o.batch / ranks
  for b = 1, o.batch do
    local row, tgt = {}, {}
    for i = 1, o.ctx + 1 do
      x = (x * 48271) % 2147483647
      local tok = x % cfg.vocab_size
      if i <= o.ctx then row[i] = tok end
      if i > 1 then tgt[i - 1] = tok end
    end
    if b > rank * mine and b <= (rank + 1) * mine then
      rows[#rows + 1], targets[#targets + 1] = row, tgt
    end
  end
  return fsdp.tensor(rows, { dtype = "i64" }), fsdp.tensor(targets, { dtype = "i64" })
end

local tags = { "param", "grad", "optimizer", "comm", "activation" }

-- Trains 1 + o.steps steps sharded with `entry`; returns the measurements
-- of the last o.steps (the maximum over ranks).
local function run(entry)
  collectgarbage()
  collectgarbage()
  local base = {}                           -- whatever an earlier policy left behind
  for _, tag in ipairs(tags) do base[tag] = fsdp.memory.stats(tag).current end
  local model = nn.GPT(cfg)
  local sharded = fsdp.shard(model, shard_opts(entry))
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-3, betas = { 0.9, 0.95 } })
  local x, y = batch()
  local function step()
    local _, loss = model(x, y)
    loss:backward()
    sharded:clip_grad_norm(1.0)
    opt:step()
    sharded:zero_grad()
    return loss:item()
  end
  step()                                    -- warm-up: optimizer state, prefetch order
  sharded:global_stats()                    -- resets the traffic counters
  fsdp.memory.reset_peak()
  local t0, loss = now(), nil
  for _ = 1, o.steps do loss = step() end
  local dt = (now() - t0) / o.steps
  local g = sharded:global_stats()          -- traffic and peaks, the maximum over ranks
  -- peaks above what was there before this policy's model, maximum over ranks
  local vals = {}
  for i, tag in ipairs(tags) do vals[i] = fsdp.memory.stats(tag).peak - base[tag] end
  vals[#tags + 1] = dt
  vals = dist.max(vals)
  local m = { peak = {}, loss = loss, ms = vals[#tags + 1] * 1e3, gathered = g.gathered_bytes / o.steps,
    reduced = g.reduced_bytes / o.steps, wait_ms = g.wait_seconds / o.steps * 1e3 }
  for i, tag in ipairs(tags) do m.peak[tag] = vals[i] end
  return m
end

say("wrap policies for GPT %s (%.2fM parameters) on %d rank%s, %s, compute %s, limit %d%s", o.preset,
  nn.GPT(cfg):num_parameters() / 1e6, world, world == 1 and "" or "s", o.strategy, o.dtype, o.limit,
  measure and string.format("; measuring %d steps, global batch %d x %d", o.steps, o.batch, o.ctx) or
  "; plans only (run under mpirun, or with --measure, to measure)")

local summary, mismatches = {}, {}
local found = false
for _, entry in ipairs(policies) do
  if not o.policy or o.policy == entry.name then
    found = true
    -- the plan: this model sharded on `world` ranks, two real steps on the
    -- counting device (rank 0's figures)
    local plan_batch = o.batch % world == 0 and o.batch or world
    local p = planner.plan(nn.GPT(cfg), shard_opts(entry), world, { batch = plan_batch, ctx = o.ctx })
    say("")
    say("== %s: %s", entry.name, entry.about)
    if o.verbose then
      say("%s", planner.format(p))
    else
      local names = {}
      for _, u in ipairs(p.units) do names[#names + 1] = string.format("%s (%.1fk)", u.name, u.numel / 1e3) end
      say("%d unit%s: %s", #p.units, #p.units == 1 and "" or "s", table.concat(names, ", "))
    end
    local m = measure and run(entry) or nil
    local mx = p.memory
    local rows = {
      { "param peak, MiB", mib(mx.param.peak), m and mib(m.peak.param) },
      { "grad peak, MiB", mib(mx.grad.peak), m and mib(m.peak.grad) },
      { "optimizer, MiB", mib(mx.optimizer.peak), m and mib(m.peak.optimizer) },
      { "param + grad + optimizer, MiB", mib(p.peak),
        m and mib(m.peak.param + m.peak.grad + m.peak.optimizer) },
      { "comm peak, MiB", mib(mx.comm.peak), m and mib(m.peak.comm) },
      { "activation peak, MiB", mib(mx.activation.peak), m and mib(m.peak.activation) },
      { "all-gathered per step, MiB", mib(p.traffic.gathered_bytes), m and mib(m.gathered) },
      { "reduced per step, MiB", mib(p.traffic.reduced_bytes), m and mib(m.reduced) },
      { "comm wait per step, ms", "-", m and string.format("%.1f", m.wait_ms) },
      { "time per step, ms", "-", m and string.format("%.1f", m.ms) },
    }
    say("  %-32s %10s %10s   (planned: rank 0; measured: max over ranks)", "", "planned", m and "measured" or "")
    for _, r in ipairs(rows) do say("  %-32s %10s %10s", r[1], r[2], r[3] or "") end
    summary[#summary + 1] = { entry.name, #p.units, p.peak, p.traffic.gathered_bytes + p.traffic.reduced_bytes, m }
    if o.check and m then
      -- the plan's collectives complete at once: a real comm thread that
      -- lags holds flat gradients longer, up to the prefetch limit's worth
      -- of the largest unit's more
      local flat = 0
      for _, u in ipairs(p.units) do flat = math.max(flat, u.padded * (o.dtype == "bf16" and 2 or 4)) end
      local pairs_ = { { "param peak", m.peak.param, mx.param.peak },
        { "grad peak", m.peak.grad, (mx.grad.peak + o.limit * flat) / 1.1, mx.grad.peak },
        { "optimizer", m.peak.optimizer, mx.optimizer.peak }, { "gathered bytes", m.gathered, p.traffic.gathered_bytes },
        { "reduced bytes", m.reduced, p.traffic.reduced_bytes } }
      for _, c in ipairs(pairs_) do
        local low = c[4] or c[3]
        if c[2] < 0.9 * low or c[2] > 1.1 * c[3] then
          mismatches[#mismatches + 1] = string.format("%s: %s measured %.0f, predicted %.0f", entry.name, c[1], c[2],
            c[3])
        end
      end
    end
  end
end
if not found then
  local names = {}
  for _, e in ipairs(policies) do names[#names + 1] = e.name end
  options.fail("wrap_policies.lua: no policy '%s' (the table has %s)", o.policy, table.concat(names, ", "))
end

say("")
say("summary (per rank, max over ranks)")
say("  %-10s %6s %22s %22s %10s", "policy", "units", "param+grad+opt MiB", "traffic MiB/step", "ms/step")
for _, s in ipairs(summary) do
  local m = s[5]
  local measured_mem = m and ("/" .. mib(m.peak.param + m.peak.grad + m.peak.optimizer)) or ""
  local measured_traffic = m and ("/" .. mib(m.gathered + m.reduced)) or ""
  say("  %-10s %6d %22s %22s %10s", s[1], s[2], mib(s[3]) .. measured_mem, mib(s[4]) .. measured_traffic,
    m and string.format("%.1f", m.ms) or "-")
end
if measure then say("  (predicted/measured)") end
if o.check then
  for _, msg in ipairs(mismatches) do say("check failed: %s", msg) end
  if #mismatches > 0 then os.exit(1) end
  say("check: measurements within 10%% of the plan%s", measure and "" or " (nothing measured)")
end
