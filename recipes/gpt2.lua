-- gpt2.lua: trains a GPT-2-style model on a text file or llm.c token shards.
--   fsdp-lua recipes/gpt2.lua --preset=tiny --steps=200
--   fsdp-lua recipes/gpt2.lua --preset=small --batch=4 --ctx=64 --steps=10 --threads=2
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
  { "batch", "int", 8, "sequences per step" },
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

-- Data: bytes of a text file, or token shards.
local function loader(path, seed)
  local spec = { batch = o.batch, ctx = o.ctx, seed = seed, shuffle = true }
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
if o.init then
  model:from_hf((require "fsdp.safetensors").load(o.init))
else
  model:materialize { seed = o.seed }
end
if o.checkpoint then nn.checkpoint(model, "Block") end
print(string.format("%s %s: %.2fM parameters, %d layers, width %d, vocab %d (padded %d), batch %d x %d, %s",
  o.model, o.preset, model:num_parameters() / 1e6, cfg.n_layer, cfg.n_embd, cfg.vocab_size, model.padded_vocab,
  o.batch, o.ctx, o.dtype))

local opt = optim.AdamW(optim.decay_groups(model:named_parameters(), o.wd),
  { lr = o.lr, betas = { 0.9, 0.95 }, eps = 1e-8 })
local lr_at = optim.schedule.cosine(o.lr, o.warmup, o.steps, o.min_lr)
local params = model:parameters()

local function evaluate()
  model:eval()
  local total = 0
  fsdp.no_grad(function()
    for _ = 1, o.eval_steps do
      local x, y = val:next()
      local _, loss = model:compute_in(o.dtype, model.forward, model, x, y)
      total = total + loss:item()
    end
  end)
  model:train()
  return total / o.eval_steps
end

local tokens = o.batch * o.ctx
local t_total = 0
local now = require("fsdp.timer").now
for step = 1, o.steps do
  local t0 = now()
  local lr = lr_at(step)
  opt:set_lr(lr)
  local x, y = train:next()
  local _, loss = model:compute_in(o.dtype, model.forward, model, x, y)
  loss:backward()
  local norm = o.clip > 0 and optim.clip_grad_norm(params, o.clip) or optim.grad_norm(params)
  opt:step()
  opt:zero_grad()
  local l = loss:item()
  local dt = now() - t0
  t_total = t_total + dt
  if step == 1 or step % o.log_every == 0 or step == o.steps then
    print(string.format("step %5d | loss %.4f | lr %.2e | grad norm %.3f | %.1f ms/step | %.0f tokens/s",
      step, l, lr, norm, dt * 1e3, tokens / dt))
  end
  if o.eval_every > 0 and (step % o.eval_every == 0 or step == o.steps) then
    print(string.format("step %5d | eval loss %.4f", step, evaluate()))
  end
end
local peak = fsdp.memory.stats().peak
print(string.format("done: %d steps, %.1f ms/step on average, peak engine memory %.1f MiB", o.steps,
  t_total / o.steps * 1e3, peak / 2 ^ 20))

if o.sample > 0 then
  local prompt = val:next():narrow(1, 1, 1):narrow(2, 1, math.min(16, o.ctx))
  local rows = model:generate(prompt, o.sample, { top_k = o.top_k, seed = o.seed })
  if cfg.vocab_size == 256 then
    local bytes = {}
    for i, v in ipairs(rows[1]) do bytes[i] = string.char(v) end
    print("sample: " .. (table.concat(bytes):gsub("[%c]", " ")))
  else
    print("sample tokens: " .. table.concat(rows[1], " "))
  end
end

if o.export then
  (require "fsdp.safetensors").save(o.export, model:to_hf(), { format = "pt" })
  print("wrote " .. o.export)
end
