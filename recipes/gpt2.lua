-- gpt2.lua: trains a GPT-2-style model on a text file or llm.c token shards,
-- on one rank or fully sharded over many.
--   fsdp-lua recipes/gpt2.lua --preset=tiny --steps=200
--   mpirun -np 2 fsdp-lua recipes/gpt2.lua --wrap=block --strategy=full_shard
--   fsdp-lua recipes/gpt2.lua --preset=small --batch=4 --ctx=64 --steps=10 --threads=2
--   fsdp-lua --plan --world=8 recipes/gpt2.lua --preset=small
--   mpirun -np 2 fsdp-lua recipes/gpt2.lua --save-every=50 --keep=3      # checkpoints/step_00000050 ...
--   mpirun -np 3 fsdp-lua recipes/gpt2.lua --save-every=50 --resume      # on from the newest, any rank count
--   fsdp-lua recipes/gpt2.lua --help
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local data = require "fsdp.data"
local options = require "fsdp.options"

local o = options.parse(..., {
  { "preset", { "tiny", "small" }, "tiny", "model size: tiny (tests) or small (GPT-2 124M)" },
  { "model", { "gpt", "llama" }, "gpt", "architecture" },
  { "data", "string", "data/corpus.txt", "a text file (byte tokens) or a glob of .bin token shards" },
  { "val_data", "string", nil, "evaluation data (default: the training data)" },
  { "steps", "int", 200, "training steps" },
  { "batch", "int", 8, "sequences per step (the global batch, over all ranks)" },
  { "accum", "int", 1, "micro-batches per step (gradient accumulation)" },
  { "accum_sync", "bool", true, "reduce gradients after every micro-batch (false: only after the last)" },
  { "strategy", { "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" }, nil,
    "sharding strategy (default: full_shard under mpirun, unsharded on one rank)" },
  { "group_size", "int", nil, "hybrid_shard: ranks per shard group" },
  { "wrap", { "block", "size", "none" }, "block", "wrap policy: per transformer block, by size, root only" },
  { "wrap_size", "int", 100000, "--wrap=size: parameters per unit at least" },
  { "prefetch", { "backward_pre", "backward_post", "none" }, "backward_pre", "backward prefetch" },
  { "forward_prefetch", "bool", false, "prefetch the next unit during forward" },
  { "limit", "int", 2, "gathered units alive at once (besides the root)" },
  { "reduce", { "f32", "bf16" }, "f32", "gradient reduction dtype (sharded runs)" },
  { "offload", "bool", false, "keep shards and optimizer state in host memory (sharded runs on a GPU)" },
  { "ctx", "int", 64, "tokens per sequence" },
  { "lr", "number", 1e-3, "peak learning rate" },
  { "min_lr", "number", 1e-4, "learning rate at the end of the cosine decay" },
  { "warmup", "int", 10, "linear warmup steps" },
  { "wd", "number", 0.1, "weight decay on matrices and embeddings" },
  { "clip", "number", 1.0, "gradient clipping by global norm (0 = off)" },
  { "dtype", { "f32", "bf16" }, "f32", "compute dtype (parameters and optimizer stay f32)" },
  { "checkpoint", "bool", false, "recompute each block's forward during backward" },
  { "eval_every", "int", 50, "evaluate every N steps (0 = never)" },
  { "eval_steps", "int", 4, "batches per evaluation" },
  { "log_every", "int", 10, "log every N steps" },
  { "seed", "int", 1, "init and data order seed" },
  { "threads", "int", nil, "CPU threads (default: all cores)" },
  { "sample", "int", 64, "tokens to generate at the end (0 = none)" },
  { "top_k", "int", 1, "1 = greedy; >1 samples among the k most likely" },
  { "init", "string", nil, "a Hugging Face GPT-2 safetensors file to start from" },
  { "export", "string", nil, "write the trained weights (HF names) to this safetensors file" },
  { "save_every", "int", 0, "save a sharded checkpoint every N steps (0 = never)" },
  { "save_dir", "string", "checkpoints/", "where checkpoints go, one step_NNNNNNNN folder each" },
  { "keep", "int", 0, "keep only the newest K checkpoints in --save-dir (0 = all)" },
  { "resume", "path or flag", nil, "--resume: go on from the newest checkpoint in --save-dir (if any); "
    .. "--resume=PATH: from that checkpoint, or the newest under PATH" },
}, "gpt2.lua")

if o.threads then fsdp.set_num_threads(o.threads) end

local presets = {
  tiny = { vocab_size = 256, n_layer = 2, n_head = 4, n_embd = 64, block_size = 64 },
  small = { vocab_size = 50257, n_layer = 12, n_head = 12, n_embd = 768, block_size = 1024 },
}
local cfg = presets[o.preset]
if o.ctx > cfg.block_size then
  error(string.format("gpt2.lua: --ctx=%d is longer than the %s model's context of %d", o.ctx, o.preset,
    cfg.block_size), 0)
end

local rank, world = fsdp.rank(), fsdp.world()
local sharding = o.strategy ~= nil or world > 1 or require("fsdp.shard").plan_mode ~= nil
local strategy = o.strategy or "full_shard"
local function log(...) if rank == 0 then print(string.format(...)) end end
if o.batch % (world * o.accum) ~= 0 then
  error(string.format("gpt2.lua: --batch=%d is not divisible by %d ranks x %d micro-batches", o.batch, world,
    o.accum), 0)
end

-- Data: bytes of a text file, or token shards; each rank reads its rows
-- of every global batch.
local function loader(path, seed)
  local spec = { batch = o.batch, ctx = o.ctx, seed = seed, shuffle = true, rank = rank, world = world }
  if path:match("%.bin$") or path:match("[%*%?]") then
    spec.pattern = path
    return data.TokenLoader(spec)
  end
  spec.path = path
  return data.ByteLoader(spec)
end
local train = loader(o.data, o.seed)
local val = loader(o.val_data or o.data, o.seed + 1)

local model = (o.model == "llama" and nn.Llama or nn.GPT)(cfg)
if o.init then model:from_hf((require "fsdp.safetensors").load(o.init)) end
if o.checkpoint then nn.checkpoint(model, "Block") end
log("%s %s: %.2fM parameters, %d layers, width %d, vocab %d (padded %d), batch %d x %d, %s, %d rank(s)%s",
  o.model, o.preset, model:num_parameters() / 1e6, cfg.n_layer, cfg.n_embd, cfg.vocab_size, model.padded_vocab,
  o.batch, o.ctx, o.dtype, world, sharding and (", " .. strategy .. ", wrap " .. o.wrap) or "")

-- Sharded: each rank initializes and keeps 1/N of every unit. Unsharded:
-- the whole model here.
local sharded, opt, grad_norm, clip, zero_grad
local betas = { 0.9, 0.95 }
if sharding then
  local policies = { block = fsdp.policy.per_block(), size = fsdp.policy.by_size(o.wrap_size),
    none = fsdp.policy.none() }
  sharded = fsdp.shard(model, {
    policy = policies[o.wrap], strategy = strategy, group_size = o.group_size, seed = o.seed,
    mixed_precision = { compute = o.dtype, reduce = o.reduce }, prefetch = o.prefetch,
    forward_prefetch = o.forward_prefetch, limit = o.limit, offload = o.offload,
  })
  opt = optim.AdamW(sharded:param_groups(o.wd), { lr = o.lr, betas = betas, eps = 1e-8 })
  grad_norm = function() return sharded:grad_norm() end
  clip = function(max) return sharded:clip_grad_norm(max) end
  zero_grad = function() sharded:zero_grad() end
else
  if not o.init then model:materialize { seed = o.seed } end
  opt = optim.AdamW(optim.decay_groups(model:named_parameters(), o.wd), { lr = o.lr, betas = betas, eps = 1e-8 })
  local params = model:parameters()
  grad_norm = function() return optim.grad_norm(params) end
  clip = function(max) return optim.clip_grad_norm(params, max) end
  zero_grad = function() opt:zero_grad() end
end
local lr_at = optim.schedule.cosine(o.lr, o.warmup, o.steps, o.min_lr)

-- Checkpoints: sharded (each rank writes its own file; any rank count can
-- load them), holding the parameters, the optimizer, the step (and so the
-- LR schedule's position), both loaders' positions and the dropout RNG.
local ckpt = require "fsdp.checkpoint"
local dropout_rng = require("fsdp.nn.layers").dropout_rng
local ckpt_model = sharding and sharded or model
local first_step = 1
if o.resume ~= nil and o.resume ~= false then
  if o.resume ~= true and type(o.resume) ~= "string" then
    error("gpt2.lua: --resume expects a checkpoint path or nothing, got '" .. tostring(o.resume) .. "'", 0)
  end
  local path = o.resume == true and o.save_dir or o.resume
  local dir = path
  local f = io.open(path .. "/index.json", "rb")
  if f then f:close() else dir = ckpt.latest(path) end
  if dir then
    local info = ckpt.load(dir, { model = ckpt_model, optim = opt })
    first_step = info.step + 1
    train:set_state(info.data)
    if info.extra and info.extra.val then val:set_state(info.extra.val) end
    if info.rng then dropout_rng.seed, dropout_rng.offset = info.rng.dropout_seed, info.rng.dropout_offset end
    log("resumed from %s (saved by %d rank(s)): step %d, next data window %d of epoch %d", dir, info.world_size,
      info.step, info.data.index, info.data.epoch)
  elseif o.resume == true then
    log("--resume: no checkpoint under %s yet; starting at step 1", path)
  else
    error("gpt2.lua: --resume=" .. path .. ": no checkpoint there (no index.json, no step_* folders)", 0)
  end
end
local function save_checkpoint(step)
  local dir = ckpt.save_step(o.save_dir, step, {
    model = ckpt_model, optim = opt, step = step, data = train:state(),
    schedule = { step = step, kind = "cosine", lr = o.lr, warmup = o.warmup, total = o.steps, min_lr = o.min_lr },
    rng = { dropout_seed = dropout_rng.seed, dropout_offset = dropout_rng.offset },
    extra = { val = val:state(), preset = o.preset, model = o.model, seed = o.seed },
  }, { keep = o.keep > 0 and o.keep or nil })
  log("step %5d | saved %s", step, dir)
end
local dtype = sharding and "f32" or o.dtype   -- sharded runs gather in the compute dtype already

-- the mean of a value over ranks
local mean_box = require("ffi").new("double[1]")
local function mean_over_ranks(v)
  if not sharding then return v end
  mean_box[0] = v
  if fsdp.C.fsdp_all_reduce_doubles(sharded.world, mean_box, 1, 1) ~= 0 then fsdp.core.raise() end
  return mean_box[0]
end

local function evaluate()
  model:eval()
  local total = 0
  fsdp.no_grad(function()
    for _ = 1, o.eval_steps do
      local x, y = val:next()
      local _, loss = model:compute_in(dtype, model.forward, model, x, y)
      total = total + loss:item()
    end
  end)
  model:train()
  return mean_over_ranks(total / o.eval_steps)
end

local tokens = o.batch * o.ctx
local t_total = 0
local now = require("fsdp.timer").now
for step = first_step, o.steps do
  local t0 = now()
  local lr = lr_at(step)
  opt:set_lr(lr)
  local x, y = train:next()
  local rows = x:shape()[1] / o.accum
  local l = 0
  for m = 1, o.accum do
    local xs, ys = x:narrow(1, (m - 1) * rows + 1, rows), y:narrow(1, (m - 1) * rows + 1, rows)
    local function micro()
      local _, loss = model:compute_in(dtype, model.forward, model, xs:contiguous(), ys:contiguous())
      if o.accum > 1 then loss = loss * (1 / o.accum) end
      loss:backward()
      l = l + loss:item()
    end
    if sharding and m < o.accum and not o.accum_sync then sharded:no_sync(micro) else micro() end
  end
  local norm = o.clip > 0 and clip(o.clip) or grad_norm()
  opt:step()
  zero_grad()
  l = mean_over_ranks(l)
  local dt = now() - t0
  t_total = t_total + dt
  if step == 1 or step % o.log_every == 0 or step == o.steps then
    log("step %5d | loss %.4f | lr %.2e | grad norm %.3f | %.1f ms/step | %.0f tokens/s", step, l, lr, norm,
      dt * 1e3, tokens / dt)
    if sharding then
      local g = sharded:global_stats()   -- max over ranks, since the last log line
      log("           | gathered %.1f MiB, reduced %.1f MiB, comm wait %.1f ms | peak MiB: param %.1f, grad %.1f, "
        .. "optimizer %.1f, activation %.1f", g.gathered_bytes / 2 ^ 20, g.reduced_bytes / 2 ^ 20,
        g.wait_seconds * 1e3, g.peak.param / 2 ^ 20, g.peak.grad / 2 ^ 20, g.peak.optimizer / 2 ^ 20,
        g.peak.activation / 2 ^ 20)
    end
  end
  if o.eval_every > 0 and (step % o.eval_every == 0 or step == o.steps) then
    log("step %5d | eval loss %.4f", step, evaluate())
  end
  if o.save_every > 0 and step % o.save_every == 0 then save_checkpoint(step) end
end
local peak = fsdp.memory.stats().peak
local ran = math.max(1, o.steps - first_step + 1)
log("done: %d steps, %.1f ms/step on average, peak engine memory %.1f MiB (rank 0)", o.steps,
  t_total / ran * 1e3, peak / 2 ^ 20)

if o.sample > 0 then
  -- every rank runs the forwards (sharded units gather collectively)
  local prompt = val:next():narrow(1, 1, 1):narrow(2, 1, math.min(16, o.ctx))
  local rows = model:generate(prompt, o.sample, { top_k = o.top_k, seed = o.seed })
  if cfg.vocab_size == 256 then
    local bytes = {}
    for i, v in ipairs(rows[1]) do bytes[i] = string.char(v) end
    log("sample: %s", (table.concat(bytes):gsub("[%c]", " ")))
  else
    log("sample tokens: %s", table.concat(rows[1], " "))
  end
end

if o.export then   -- HF names; streamed unit by unit, never the whole model on one rank
  fsdp.checkpoint.export(o.export, sharding and sharded or model, { hf = true })
  log("wrote %s", o.export)
end
