-- gpt2.lua: trains a GPT-2-style model on a text file or llm.c token shards,
-- with the same code on one rank and fully sharded over many.
--   fsdp-lua recipes/gpt2.lua --preset=tiny --steps=200
--   mpirun -np 2 fsdp-lua recipes/gpt2.lua --wrap=block --strategy=full_shard
--   fsdp-lua --plan --world=8 recipes/gpt2.lua --preset=small
--   mpirun -np 2 fsdp-lua recipes/gpt2.lua --save-every=50 --keep=3      # checkpoints/step_00000050 ...
--   mpirun -np 3 fsdp-lua recipes/gpt2.lua --save-every=50 --resume      # on from the newest, any rank count
--   fsdp-lua recipes/gpt2.lua --help
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local data = require "fsdp.data"
local options = require "fsdp.options"
local metrics = require "fsdp.metrics"
local sample = require "fsdp.sample"
local dist, log = fsdp.distributed, fsdp.distributed.print0

local o = options.parse(..., {
  { "preset", nn.gpt_preset_names, "tiny", "model size: tiny (tests) or small (GPT-2 124M)" },
  { "model", { "gpt", "llama" }, "gpt", "architecture" },
  { "layers", "int", nil, "transformer blocks (default: the preset's)", min = 1 },
  { "width", "int", nil, "model width, the embedding size (default: the preset's)", min = 1 },
  { "heads", "int", nil, "attention heads, dividing the width (default: the preset's)", min = 1 },
  { "hidden", "int", nil, "MLP hidden size (default: 4 x width; Llama's SwiGLU 8/3 x width)", min = 1 },
  { "vocab", "int", nil, "vocabulary size (default: the preset's; the data's token ids lie below it)", min = 1 },
  { "data", "string", fsdp.shipped("data/corpus.txt"), "a text file (byte tokens), a glob of .bin token shards, or their folder" },
  { "val_data", "string", nil, "evaluation data (default: held out from --data)" },
  { "steps", "int", 200, "training steps", min = 1 },
  { "batch", "int", 8, "sequences per step (the global batch, over all ranks)", min = 1 },
  { "accum", "int", 1, "micro-batches per step (gradient accumulation)", min = 1 },
  { "accum_sync", "bool", true, "reduce gradients after every micro-batch (false: only after the last)" },
  { "strategy", { "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" }, "full_shard", "sharding strategy" },
  { "group_size", "int", nil, "hybrid_shard: ranks per shard group", min = 1 },
  { "wrap", { "block", "size", "none" }, "block", "wrap policy: per transformer block, by size, root only" },
  { "wrap_size", "int", 100000, "--wrap=size: parameters per unit at least", min = 1 },
  { "prefetch", { "backward_pre", "backward_post", "none" }, "backward_pre", "backward prefetch" },
  { "forward_prefetch", "bool", true, "gather the next unit while this one computes, in forward (--no-forward-prefetch: off)" },
  { "limit", "int", 2, "gathered units alive at once (besides the root)", min = 1 },
  { "reduce", { "f32", "bf16" }, "f32", "gradient reduction dtype" },
  { "offload", "bool", false, "keep shards and optimizer state in host memory (on a GPU)" },
  { "compute_copy", "bool", nil, "--dtype=bf16: keep the master shards' bf16 copies, which AdamW writes, for the "
    .. "gathers to send (2 bytes per parameter per shard; false: cast at every gather; default: on unless --offload)" },
  { "reshard_group", "int", 0, "keep 1/N of each block after its forward and regather it for the backward within "
    .. "groups of N ranks (hpZ; 0 = free it, the default)", min = 0 },
  { "grad_compress", { "none", "int8", "topk" }, "none", "compressed gradient reduction: int8 blocks or top-k "
    .. "entries, with error feedback (a residual kept per rank and checkpointed)" },
  { "topk_density", "number", 0.01, "--grad-compress=topk: the fraction of each rank's part sent", min = 0, max = 1 },
  { "compress_block", "int", 256, "--grad-compress=int8: elements per scale (a power of two)", min = 1 },
  { "error_feedback", "bool", true, "keep what compression did not send and add it to the next step's gradient" },
  { "ctx", "int", 64, "tokens per sequence", min = 1 },
  { "lr", "number", 1e-3, "peak learning rate", min = 0 },
  { "min_lr", "number", 1e-4, "learning rate at the end of the cosine decay", min = 0 },
  { "warmup", "int", 10, "linear warmup steps", min = 0 },
  { "wd", "number", 0.1, "weight decay on matrices and embeddings", min = 0 },
  { "clip", "number", 1.0, "gradient clipping by global norm (0 = off)", min = 0 },
  { "dtype", { "f32", "bf16" }, "f32", "compute dtype (master weights and optimizer stay f32)" },
  { "recompute", "bool", false, "recompute each block's forward during backward (less activation memory)" },
  { "head_chunk", "int", 0, "LM head and loss by vocabulary chunks of N rows (0 = whole, the fastest); sharded, the "
    .. "tied embedding is then gathered and reduced a chunk at a time (memory-first)", min = 0 },
  { "eval_every", "int", 50, "evaluate every N steps (0 = never)", min = 0 },
  { "eval_steps", "int", 4, "batches per evaluation", min = 1 },
  { "log_every", "int", 10, "log every N steps", min = 1 },
  { "seed", "int", 1, "init and data order seed", min = 0 },
  { "threads", "int", nil, "CPU threads (default: all cores)", min = 1, max = 256 },
  { "sample", "int", 64, "tokens to generate at the end (0 = none)", min = 0 },
  { "top_k", "int", 40, "sample among the k most likely tokens (0 = all of them, 1 = greedy)", min = 0 },
  { "temperature", "number", 0.8, "sampling temperature (0 = greedy)", min = 0 },
  { "top_p", "number", 1.0, "nucleus sampling: the most likely tokens up to this probability (1 = off)", min = 0,
    max = 1 },
  { "prompt", "string", nil, "text the samples continue, tokenized as the data is (default: 16 held-out tokens)" },
  { "num_samples", "int", 1, "samples printed each time", min = 1 },
  { "sample_seed", "int", nil, "the samples' seed (default: --seed)", min = 0 },
  { "sample_every", "int", 0, "also print samples every N training steps (0 = only at the end)", min = 0 },
  { "eval_only", "bool", false, "evaluate the --resume checkpoint (or the --init weights) and stop" },
  { "generate_only", "bool", false, "print samples from the --resume checkpoint (or the --init weights) and stop" },
  { "init", "file", nil, "a Hugging Face GPT-2 safetensors file to start from" },
  { "export", "outfile", nil, "write the trained weights (HF names) to this safetensors file" },
  { "metrics", "outfile", nil, "write one JSON object per step to this file (tools/plot draws it)" },
  { "save_every", "int", 0, "save a sharded checkpoint every N steps (0 = never)", min = 0 },
  { "save_dir", "string", "checkpoints/", "where checkpoints go, one step_NNNNNNNN folder each" },
  { "keep", "int", 0, "keep only the newest K checkpoints in --save-dir (0 = all)", min = 0 },
  { "nan", { "stop", "skip" }, "stop", "a loss, gradient norm or parameter that is NaN or infinite: stop the run "
    .. "there (exit status 3, nothing saved from it) or skip the step's update (counted, logged)" },
  { "resume", "path_or_flag", nil, "--resume: go on from the newest checkpoint in --save-dir (if any); "
    .. "--resume=PATH: from that checkpoint, or the newest under PATH" },
}, "gpt2.lua")

if o.threads then fsdp.set_num_threads(o.threads) end
local cfg, world = nn.gpt_preset(o.preset), dist.world()
if o.head_chunk > 0 then cfg.head_chunk = o.head_chunk end
-- a shape of one's own over the preset's (its vocabulary and context stay)
cfg.n_layer, cfg.n_embd, cfg.n_head = o.layers or cfg.n_layer, o.width or cfg.n_embd, o.heads or cfg.n_head
cfg.hidden, cfg.vocab_size = o.hidden or cfg.hidden, o.vocab or cfg.vocab_size
options.check("gpt2.lua", {   -- what cannot work is refused before anything is built
  { o.ctx <= cfg.block_size, "--ctx=%d is longer than the %s model's context of %d", o.ctx, o.preset, cfg.block_size },
  { cfg.n_embd % cfg.n_head == 0, "the width %d is not divisible by %d heads (--width, --heads)", cfg.n_embd,
    cfg.n_head },
  { o.model ~= "llama" or cfg.n_embd % cfg.n_head ~= 0 or (cfg.n_embd / cfg.n_head) % 2 == 0, "--model=llama "
    .. "rotates pairs of each head's dimensions: the head size %d (width %d / %d heads) must be even",
    math.floor(cfg.n_embd / cfg.n_head), cfg.n_embd, cfg.n_head },
  { not o.init or not (o.layers or o.width or o.heads or o.hidden or o.vocab), "--init loads GPT-2's own shape: "
    .. "leave out --layers, --width, --heads, --hidden and --vocab" },
  { o.batch % (world * o.accum) == 0, "--batch=%d is not divisible by %d ranks x %d micro-batches", o.batch, world,
    o.accum },
  { o.model == "gpt" or not (o.export or o.init), "--%s uses Hugging Face GPT-2 names, which --model=%s does not "
    .. "have", o.export and "export" or "init", o.model },
  { (o.strategy == "hybrid_shard") == (o.group_size ~= nil), "--group-size goes with --strategy=hybrid_shard, and "
    .. "that needs it" },
  { not o.group_size or world % o.group_size == 0, "--group-size=%s does not divide the world size %d",
    tostring(o.group_size), world },
  { o.reshard_group == 0 or (o.group_size or world) % o.reshard_group == 0,
    "--reshard-group=%d does not divide the shard group of %d ranks", o.reshard_group, o.group_size or world },
  { o.top_p > 0, "--top-p must be above 0 (1 = off), got %s", o.top_p },
  { o.prompt ~= "", "--prompt is empty: give some text to continue, or leave it out" },
  { not (o.eval_only or o.generate_only) or o.resume or o.init, "--%s needs weights: --resume[=PATH] (a checkpoint) "
    .. "or --init=FILE", o.eval_only and "eval-only" or "generate-only" },
})
local run = fsdp.checkpoint.manager { save_dir = o.save_dir, save_every = o.save_every, keep = o.keep,
  resume = o.resume, what = "gpt2.lua" }   -- refuses a --resume=PATH without a checkpoint now
if (o.eval_only or o.generate_only) and o.resume and not run.dir then
  options.fail("gpt2.lua: --%s: no checkpoint in %s to start from", o.eval_only and "eval-only" or "generate-only",
    run.resume_from)
end
-- the prompt in the data's tokens (bytes for the tiny preset, GPT-2's BPE for small)
local prompt_ids = o.prompt and require("fsdp.tokenizer").encode_for(cfg.vocab_size, o.prompt)

-- Data: each rank reads its rows of every global batch. Evaluation reads
-- data held out from training: --val-data, or else the last tenth of a
-- text file, a folder's val_* shards, or a glob's last shard.
local split_ok, train, val = pcall(data.splits, { data = o.data, val_data = o.val_data, batch = o.batch, ctx = o.ctx,
  seed = o.seed, what = "gpt2.lua", flags = { data = "--data", val_data = "--val-data" } })
if not split_ok then
  -- data the loaders refuse (empty, shorter than one batch, a damaged shard) is a usage error: one line
  if options.is_usage_error(train) then error(train, 0) end
  options.fail("gpt2.lua: %s", (tostring(train):gsub("^[^\n]-:%d+: ", ""):gsub("\n.*", "")))
end
for _, d in ipairs { { train, "data" }, { val, "val-data" } } do   -- token ids the model has no row for
  -- every id, not a sample: an id past the vocabulary (the padded rows too) would read a row no token owns
  local shard, at, id = d[1]:first_beyond(cfg.vocab_size)
  local flag = d[2] == "data" and "--data" or (o.val_data and "--val-data" or "--data")
  if shard then
    local top = d[1]:max_token()
    options.fail("gpt2.lua: %s=%s: '%s' holds token id %d at token %d, beyond the %s model's vocabulary of %d%s", flag,
      flag == "--data" and o.data or o.val_data, shard, id, at, o.preset, cfg.vocab_size,
      (top < 50257 and cfg.vocab_size < 50257) and ": these look like GPT-2 token ids (vocabulary 50257): use "
        .. "--preset=small" or "")
  end
end

-- The model: declared here, sharded by fsdp.shard (on one rank its
-- parameters are views of the master copy; nothing is gathered).
-- the resolved options (--config=FILE, then the command line), once they all passed their checks
log("%s", options.describe(o))
-- A large model takes seconds to build, shard, evaluate and sample: each says so as it starts
-- (and draws a bar on a terminal), rather than leaving the log silent.
local progress, timer = require "fsdp.progress", require "fsdp.timer"
local large = 12 * cfg.n_layer * cfg.n_embd ^ 2 + cfg.vocab_size * cfg.n_embd >= 10e6
local t_build = timer.now()
if large then log("building the %s %s model ...", o.model, o.preset) end
local model = (o.model == "llama" and nn.Llama or nn.GPT)(cfg)
if o.recompute then nn.recompute(model, "Block") end
local policies = { block = fsdp.policy.per_block(), size = fsdp.policy.by_size(o.wrap_size), none = fsdp.policy.none() }
log("%s %s: %.2fM parameters, %d layers, width %d, vocab %d (padded %d), batch %d x %d, %s, %d rank(s), %s, wrap %s",
  o.model, o.preset, model:num_parameters() / 1e6, cfg.n_layer, cfg.n_embd, cfg.vocab_size, model.padded_vocab,
  o.batch, o.ctx, o.dtype, world, o.strategy, o.wrap)
if large then log("sharding it over %d rank(s) (%s, wrap %s) ...", world, o.strategy, o.wrap) end
local sharded = fsdp.shard(model, {
  policy = policies[o.wrap], strategy = o.strategy, group_size = o.group_size, seed = o.seed,
  mixed_precision = { compute = o.dtype, reduce = o.reduce }, prefetch = o.prefetch,
  forward_prefetch = o.forward_prefetch, limit = o.limit, offload = o.offload,
  reshard_after_forward = o.reshard_group > 0 and o.reshard_group or nil, compute_copy = o.compute_copy,
  compress = o.grad_compress ~= "none" and { grads = o.grad_compress, density = o.topk_density,
    block = o.compress_block, error_feedback = o.error_feedback } or nil,
})
-- --init: each rank reads only its own slices of the file, into its shard
if o.init then fsdp.checkpoint.import(o.init, sharded) end
local opt = optim.AdamW(sharded:param_groups(o.wd), { lr = o.lr, betas = { 0.9, 0.95 }, eps = 1e-8 })
if large then log("built and sharded in %.1f s", timer.now() - t_build) end
local lr_at = optim.schedule.cosine(o.lr, o.warmup, o.steps, o.min_lr)

-- Checkpoints: each rank writes its shard (any rank count can load them):
-- parameters, optimizer, step, both loaders' positions and the dropout RNG.
local first_step = run:load { model = sharded, optim = opt, data = train, val = val,
  schedule = { kind = "cosine", lr = o.lr, warmup = o.warmup, total = o.steps, min_lr = o.min_lr },
  extra = { preset = o.preset, model = o.model, seed = o.seed },
  steps = not (o.eval_only or o.generate_only) and o.steps or nil,
  config = options.plain(o) }   -- says when it leaves nothing to train

local function evaluate(step)
  if large then log("step %5d | evaluating on %d batch%s ...", step, o.eval_steps, o.eval_steps == 1 and "" or "es") end
  local bar = dist.rank() == 0 and progress.bar("eval", { unit = "batches" }) or nil
  local el = require("fsdp.evaluate").loss(model, val, o.eval_steps, bar)
  log("step %5d | eval loss %.4f", step, el)
  return el
end
-- Samples: --num-samples continuations of one prompt (--prompt, or rank 0's
-- first held-out tokens, read without moving the evaluation's position).
-- Every rank runs the forwards (sharded units gather collectively).
local function print_samples(when)
  if o.sample == 0 then return end
  local prompt = prompt_ids
  if not prompt then
    local at = val:state()
    prompt = val:next():narrow(1, 1, 1):narrow(2, 1, math.min(16, o.ctx)):tolist()[1]
    val:set_state(at)
    prompt = dist.broadcast(prompt)
  end
  local rows = {}
  for i = 1, o.num_samples do rows[i] = prompt end
  local how = { temperature = o.temperature, top_k = o.top_k, top_p = o.top_p, seed = o.sample_seed or o.seed }
  if large then log("sampling %d x %d tokens ...", #rows, o.sample) end
  local bar = dist.rank() == 0 and progress.bar("sample", { unit = "tokens" }) or nil
  if bar then how.on_token = function(i, n) bar(i, n) end end
  rows = model:generate(rows, o.sample, how)
  for i, r in ipairs(rows) do
    log("%s", sample.text(r, #prompt, cfg.vocab_size, string.format("sample %d/%d %s (%s, seed %d):", i, #rows, when,
      sample.describe(how), how.seed)))
  end
end
if o.eval_only or o.generate_only then   -- a checkpoint's figures; no training, nothing saved
  if o.eval_only then evaluate(first_step - 1) end
  if o.generate_only then print_samples(string.format("after step %d", first_step - 1)) end
  return
end
-- NaN or infinity in the loss, gradient norm or parameters: stop, or drop the update (--nan)
local guard = require("fsdp.guard").new { model = sharded, mode = o.nan, what = "gpt2.lua", checkpoints = run }

local flops_per_token = metrics.gpt_flops_per_token(model:num_parameters(), cfg.n_layer, cfg.n_embd, o.ctx)
local meter = metrics.new { path = o.metrics, tokens_per_step = o.batch * o.ctx,   -- per step, max over ranks
  flops_per_token = flops_per_token, flops_formula = metrics.FLOPS_FORMULA, total_steps = o.steps,
  config = options.plain(o), run_id = run.id }
if meter.peak_flops then
  log("MFU against %.3g TFLOP/s (%s), %s = %.2f MFLOP per token", meter.peak_flops / 1e12, meter.peak_source,
    metrics.FLOPS_FORMULA, flops_per_token / 1e6)
end
for step = first_step, o.steps do
  meter:begin_step()
  local lr = lr_at(step)
  opt:set_lr(lr)
  local x, y = train:next()
  local rows, loss = x:shape()[1] / o.accum, 0
  for m = 1, o.accum do
    local xs, ys = x:narrow(1, (m - 1) * rows + 1, rows):contiguous(), y:narrow(1, (m - 1) * rows + 1, rows):contiguous()
    local function forward_backward()
      local _, l = model(xs, ys, { logits = false })   -- the loss alone: the head keeps its logits inside
      if o.accum > 1 then l = l * (1 / o.accum) end
      l:backward()
      loss = loss + l:item()
    end
    if m < o.accum and not o.accum_sync then sharded:no_sync(forward_backward) else forward_backward() end
  end
  local norm = sharded:grad_norm()
  if guard:check_step { step = step, loss = loss, grad_norm = norm } then
    opt:step { grad_scale = o.clip > 0 and optim.clip_coef(norm, o.clip) or 1 }   -- the clip, in AdamW's pass
    guard:check_params(step)
  end
  opt:zero_grad()
  local rec = meter:end_step { step = step, loss = dist.mean(loss), lr = lr, grad_norm = norm }
  if step == 1 or step % o.log_every == 0 or step == o.steps then log("%s", meter:format(rec)) end
  if o.eval_every > 0 and (step % o.eval_every == 0 or step == o.steps) then
    meter:record { step = step, eval_loss = evaluate(step) }
  end
  if o.sample_every > 0 and step % o.sample_every == 0 and step < o.steps then print_samples("at step " .. step) end
  run:maybe_save(step)
end
meter:close()
if run.nothing_to_train then   -- (run:load said so) the checkpoint's figures, as asked
  if o.eval_every > 0 then evaluate(first_step - 1) end
else
  local s = meter:summary()
  log("done: %d step%s this run (%d..%d of %d), %.1f ms/step on average over %d%s%s, peak engine memory %.1f MiB "
    .. "(max over ranks)", s.steps, s.steps == 1 and "" or "s", s.first_step or first_step, s.last_step or o.steps,
    o.steps, s.mean_step_ms, s.timed_steps, s.warmup_steps > 0 and string.format(" (the first %d left out as "
    .. "warm-up)", s.warmup_steps) or "", s.mfu and string.format(", MFU %.2f%%", s.mfu) or "",
    s.peak_bytes / 2 ^ 20)
end
print_samples("after step " .. math.max(o.steps, first_step - 1))
if o.export then   -- HF names; streamed unit by unit, never the whole model on one rank
  fsdp.checkpoint.export(o.export, sharded, { hf = true })
  log("wrote %s", o.export)
end
-- `fsdp-lua -i recipes/gpt2.lua` leaves these as the REPL's globals
return { model = model, sharded = sharded, opt = opt, options = o }
