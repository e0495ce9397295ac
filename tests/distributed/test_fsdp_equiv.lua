-- N ranks train the tiny GPT exactly as 1 rank does on the same global
-- batch: 20 AdamW steps with clipping and 2 micro-batches per step, for a
-- strategy and a wrap policy given on the command line. Every rank also
-- trains an unsharded reference (the model is tiny) and compares losses
-- each step and all parameters at the end: within 1e-5 relative for the
-- losses and for all parameters together (||a - b|| / ||b||), 5e-4 for each
-- tensor alone. Why not 1e-5 per tensor: the attention key bias gets a
-- gradient that is zero in exact arithmetic (softmax ignores a constant
-- added to every score of a row), so what it gets is rounding noise, which
-- AdamW normalizes into full-size updates; any change of summation order,
-- even the gradient norm's, moves that one tensor by a few 1e-5.
-- The sharded model is asked for the loss alone (forward{logits = false}:
-- the fused classifier, dlogits written in the loss's pass), the reference
-- for logits and fsdp.cross_entropy.
-- --head-chunk=R: the sharded model's head and loss by vocabulary chunks of R
-- rows (its tied embedding gathered and reduced by chunks).
-- --offload keeps shards and optimizer state on the CPU (the model computes
-- on the default device: the GPU where there is one).
-- --model=llama: the Llama variant (untied embedding and head, which
-- per_block makes units of their own; with --head-chunk both are sliced units).
-- --n-head=N: N heads instead of 2 (1: head dim 16, which the fused flash
-- attention covers on CUDA in bf16; 2 heads of 8 take the GEMM path).
--   mpirun -np 3 fsdp-lua tests/distributed/test_fsdp_equiv.lua --strategy=full_shard --policy=block
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"

local opts = ... or {}
local strategy = opts.strategy or "full_shard"
local policy_name = opts.policy or "block"
local accum_sync = opts.accum_sync ~= false      -- communicate on every micro-batch
local dtype = opts.compute or "f32"
local TOL = dtype == "f32" and 1e-5 or 2e-2
local rank, world = fsdp.rank(), fsdp.world()

local cfg = { vocab_size = 96, n_layer = 2, n_head = tonumber(opts.n_head) or 2, n_embd = 16, block_size = 8 }
local B, T, STEPS, MICRO, SEED = 24, 8, 20, 2, 7

local policies = {
  block = fsdp.policy.per_block(),
  size = fsdp.policy.by_size(1000),
  custom = function(m, path) return path == "h.1" or m.__name == "MLP" end,
  none = fsdp.policy.none(),
}

-- the global batch of step s: the same on every rank
local function batch(step) return t.token_batch(step * 7919 + 17, B, T, cfg.vocab_size) end

local function adamw(groups) return optim.AdamW(groups, { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8 }) end

-- reference: one process, the whole global batch
local Model = opts.model == "llama" and nn.Llama or nn.GPT
local ref = Model(cfg):materialize { seed = SEED }
local ref_opt = adamw(optim.decay_groups(ref:named_parameters(), 0.1))
local ref_params = ref:parameters()

-- sharded: this rank's rows of each micro-batch (--head-chunk=R: the head by
-- vocabulary chunks, the tied embedding a sliced unit; the reference stays unchunked)
local scfg = {}
for k, v in pairs(cfg) do scfg[k] = v end
scfg.head_chunk = opts.head_chunk
local model = Model(scfg)
if opts.recompute then nn.recompute(model, "Block") end   -- recomputed blocks regather in backward
local sharded = fsdp.shard(model, {
  policy = policies[policy_name], strategy = strategy, group_size = opts.group_size, seed = SEED,
  mixed_precision = { compute = dtype, reduce = "f32" }, offload = opts.offload == true,
})
local opt = adamw(sharded:param_groups(0.1))
if opts.model == "llama" and world > 1 then   -- the untied tables: units of their own, or sliced by chunks
  local names = {}
  for _, u in ipairs(sharded.units) do names[u.name] = u end
  for _, n in ipairs(opts.head_chunk and { "wte.weight", "lm_head.weight" } or { "wte", "lm_head" }) do
    t.ok(names[n] ~= nil, "llama: a unit " .. n .. (opts.head_chunk and " (sliced)" or ""))
  end
end
if opts.offload then
  -- shards in host memory, the optimizer state made beside them; the model computes on the default device
  for _, u in ipairs(sharded.units) do
    t.eq(u.master:device(), "cpu", "offload: master shard of " .. u.name .. " on the cpu")
    t.eq(u.grad:device(), "cpu", "offload: gradient shard of " .. u.name .. " on the cpu")
  end
end

local per_micro = B / MICRO               -- global rows per micro-batch
local mine = per_micro / world            -- this rank's rows of one
assert(mine == math.floor(mine), "batch not divisible")

local worst_loss = 0
for step = 1, STEPS do
  local x, y = batch(step)
  -- reference
  local ref_loss = 0
  for m = 1, MICRO do
    local xs, ys = x:narrow(1, (m - 1) * per_micro + 1, per_micro), y:narrow(1, (m - 1) * per_micro + 1, per_micro)
    local _, l = ref(xs:contiguous(), ys:contiguous())
    ref_loss = ref_loss + l:item() / MICRO
    local scaled = l * (1 / MICRO)
    scaled:backward()
  end
  optim.clip_grad_norm(ref_params, 0.5)
  ref_opt:step()
  ref_opt:zero_grad()
  -- sharded
  local loss = 0
  for m = 1, MICRO do
    local first = (m - 1) * per_micro + rank * mine + 1
    local xs, ys = x:narrow(1, first, mine):contiguous(), y:narrow(1, first, mine):contiguous()
    local function run()
      local _, l = model(xs, ys, { logits = false })   -- the loss alone (the fused classifier), as recipes ask
      loss = loss + l:item() / MICRO
      local scaled = l * (1 / MICRO)
      scaled:backward()
    end
    if m < MICRO and not accum_sync then sharded:no_sync(run) else run() end
  end
  -- the loss of the global batch is the mean of the ranks' losses
  loss = fsdp.distributed.mean(loss)
  sharded:clip_grad_norm(0.5)
  opt:step()
  sharded:zero_grad()
  local rel = math.abs(loss - ref_loss) / math.abs(ref_loss)
  worst_loss = math.max(worst_loss, rel)
  t.ok(rel <= TOL, string.format("step %d: loss %.8f vs unsharded %.8f (rel %.2g)", step, loss, ref_loss, rel))
  if opts.offload and step == 1 then
    local st = opt.state[sharded.segments[1].tensor]
    t.eq(st and st.exp_avg and st.exp_avg:device(), "cpu", "offload: AdamW state on the cpu")
  end
end

-- final parameters, gathered unit by unit
local full = sharded:full_state_dict()
local worst, all_num, all_den = 0, 0, 0
for _, p in ipairs(ref:named_parameters()) do
  local a, b = full[p.path]:view(-1):tolist(), p.tensor:view(-1):tolist()
  local num, den = 0, 0
  for i = 1, #b do
    num = num + (a[i] - b[i]) ^ 2
    den = den + b[i] ^ 2
  end
  all_num, all_den = all_num + num, all_den + den
  local rel = math.sqrt(num / math.max(den, 1e-30))
  worst = math.max(worst, rel)
  t.ok(rel <= 50 * TOL, string.format("%s after %d steps: relative error %.2g", p.path, STEPS, rel))
end
local global = math.sqrt(all_num / all_den)
t.ok(global <= TOL, string.format("all parameters after %d steps: relative error %.2g", STEPS, global))
-- On the CUDA emulation (fsdp-lua-emu) the collectives must have gone
-- through NCCL on the comm stream, not around it (a world of one: when
-- FSDP_FORCE_COLLECTIVES=1, since its shard group otherwise copies locally).
local ffi = require "ffi"
ffi.cdef [[ int emu_nccl_comms_made(void); long long emu_late_runs(void); ]]
local on_emu, made = pcall(function() return ffi.C.emu_nccl_comms_made() end)
if on_emu and fsdp.default_device() == "cuda" then
  if world > 1 or os.getenv("FSDP_FORCE_COLLECTIVES") == "1" then
    t.ok(made >= 1, string.format("rank %d: %d NCCL communicator(s) made", rank, made))
    local late = tonumber(ffi.C.emu_late_runs())
    t.ok(late > 0, string.format("rank %d: %d work items ran late on the comm stream", rank, late))
  end
end

if rank == 0 then
  print(string.format("%s policy=%s ranks=%d compute=%s accum_sync=%s: worst loss rel %.2g, "
    .. "all params rel %.2g, worst tensor rel %.2g", strategy, policy_name, world, dtype, tostring(accum_sync),
    worst_loss, global, worst))
  print(sharded:describe())
end
t.done()
