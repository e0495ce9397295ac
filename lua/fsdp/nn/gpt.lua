-- GPT (the GPT-2 architecture) and a Llama-style variant.
--
-- GPT: learned positions, pre-norm blocks of LayerNorm, attention and a
-- GELU MLP, a final LayerNorm and an LM head tied to the token embedding.
-- The vocabulary is padded to a multiple of 128 (faster matmuls); padded
-- logits are excluded from the loss and from sampling. Module names equal
-- the Hugging Face GPT-2 names, so paths map one to one (HF's Conv1D stores
-- the transpose of our Linear weights; see to_hf / from_hf).
local fsdp = require "fsdp"
local Module = require "fsdp.nn.module"
local layers = require "fsdp.nn.layers"
local tr = require "fsdp.nn.transformer"

local M = {}

-- Sizes by name: tiny (byte-level, for tests and a quick look) and small
-- (GPT-2 124M).
local presets = {
  tiny = { vocab_size = 256, n_layer = 2, n_head = 4, n_embd = 64, block_size = 64 },
  small = { vocab_size = 50257, n_layer = 12, n_head = 12, n_embd = 768, block_size = 1024 },
}
M.preset_names = { "tiny", "small" }

--- A copy of the named preset's config (a caller may change it).
function M.preset(name)
  local p = presets[name]
  if not p then
    error(string.format("nn.gpt_preset: no preset '%s' (there are %s)", tostring(name),
      table.concat(M.preset_names, ", ")), 2)
  end
  local c = {}
  for k, v in pairs(p) do c[k] = v end
  return c
end

local function padded(v, multiple)
  multiple = multiple or 128
  return math.ceil(v / multiple) * multiple
end

local config_names = { "vocab_size", "n_layer", "n_head", "n_embd", "block_size", "dropout", "pad_to", "hidden",
  "theta", "head_chunk" }

local function check_config(name, cfg, keys)
  if type(cfg) ~= "table" then error(name .. ": expected a config table", 3) end
  require("fsdp.options").check_keys(cfg, config_names, name .. " config", 5)
  for _, k in ipairs(keys) do
    local v = cfg[k]
    if type(v) ~= "number" or v < 1 or v ~= math.floor(v) then
      error(string.format("%s: config.%s must be a positive integer, got %s", name, k, tostring(v)), 3)
    end
  end
  if cfg.head_chunk ~= nil then
    require("fsdp.classifier").check_chunk(cfg.head_chunk, name .. ": config.head_chunk", 3)
  end
end

-- What both models share: the checked config, the padded vocabulary, the
-- token embedding; returns the width and the residual projections' init std.
local function common_init(self, name, cfg)
  check_config(name, cfg, { "vocab_size", "n_layer", "n_head", "n_embd", "block_size" })
  self.config = cfg
  self.vocab_size = cfg.vocab_size
  self.padded_vocab = padded(cfg.vocab_size, cfg.pad_to)
  self:add("wte", layers.Embedding(self.padded_vocab, cfg.n_embd))._vocab_table = true
  self.head_chunk = cfg.head_chunk
  return cfg.n_embd, 0.02 / math.sqrt(2 * cfg.n_layer)
end

local GPT = Module:extend("GPT")
--- GPT{vocab_size=, n_layer=, n_head=, n_embd=, block_size=, dropout=0, pad_to=128, head_chunk=nil,
--      hidden=4*n_embd (the MLP's)}
-- head_chunk = R: the LM head and its loss go R vocabulary rows at a time
-- (fsdp.chunked_cross_entropy): no (B, T, V) logits in memory, and under
-- fsdp.shard the tied embedding becomes a sliced unit, gathered and reduced
-- a chunk at a time, never whole (less memory, more traffic: forward() then
-- returns no logits when given targets). nil: one matmul and the loss over
-- whole logits, wte kept gathered with the root (faster where memory allows).
function GPT:__init(cfg)
  local C, proj_std = common_init(self, "GPT", cfg)
  self.wte._used_outside_forward = true   -- the LM head reads wte.weight (sharding keeps it with the root)
  if cfg.head_chunk then self.wte._slice_rows = cfg.head_chunk end   -- fsdp.shard: a sliced unit
  self:add("wpe", layers.Embedding(cfg.block_size, C))
  local h = self:add("h", tr.ModuleList())
  for _ = 1, cfg.n_layer do
    h:append(tr.Block(C, cfg.n_head, { proj_std = proj_std, dropout = cfg.dropout, hidden = cfg.hidden }))
  end
  self:add("ln_f", layers.LayerNorm(C))
end

local function check_ids(self, idx, what)
  local s = idx:shape()
  if #s ~= 2 then error(string.format("%s: %s must be (B, T), got a %d-dim tensor", self.__name, what, #s), 3) end
  if s[2] > self.config.block_size then
    error(string.format("%s: context %d is longer than the model's block_size %d", self.__name, s[2],
      self.config.block_size), 3)
  end
  return s[1], s[2]
end

-- The head by vocabulary chunks: the loss with targets (no logits), else
-- the logits (without gradients: evaluation and sampling).
local function chunked_head(self, x, head, targets, B, T)
  local C = x:shape()[3]
  if targets then
    return nil, fsdp.chunked_cross_entropy(x:view(B * T, C), head, targets:view(B * T),
      { chunk = self.head_chunk, ignore_index = -100, valid_vocab = self.vocab_size })
  end
  return fsdp.chunked_logits(x:view(B * T, C), head, { chunk = self.head_chunk }):view(B, T, self.padded_vocab)
end

-- What forward(idx, targets, opts) may be told: logits = false (with
-- targets) asks for the loss alone. The GPT's head is then one op whose
-- logits never leave it (fsdp.classifier_cross_entropy: dlogits are written
-- over them in the loss's own pass, no (B, T, V) tensor is handed out, the
-- backward reads only dlogits); the Llama drops its logits (see there). The
-- default keeps the logits, which the caller may read.
local function wants_logits(self, targets, opts)
  if opts == nil then return true end
  if type(opts) ~= "table" then error(string.format("%s: forward options must be a table, got %s", self.__name,
    type(opts)), 3) end
  require("fsdp.options").check_keys(opts, { "logits" }, self.__name .. ":forward", 4)
  if opts.logits ~= nil and type(opts.logits) ~= "boolean" then
    error(string.format("%s: forward option logits must be a boolean, got %s", self.__name, type(opts.logits)), 3)
  end
  if opts.logits == false and not targets then
    error(string.format("%s: forward{logits = false} needs targets (the loss is all it returns)", self.__name), 3)
  end
  return opts.logits ~= false
end

-- The loss of the whole-vocabulary head without logits.
local function fused_head(self, x, head, targets, B, T)
  local C = x:shape()[3]
  return nil, fsdp.classifier_cross_entropy(x:view(B * T, C), head, targets:view(B * T),
    { ignore_index = -100, valid_vocab = self.vocab_size })
end

--- model(idx (B, T) integer, targets (B, T) or nil, opts) -> logits (B, T, padded V), loss or nil
-- (with config.head_chunk and targets, or opts.logits = false: nil, loss)
function GPT:forward(idx, targets, opts)
  local keep_logits = wants_logits(self, targets, opts)
  local B, T = check_ids(self, idx, "idx")
  local pos = self.pos_cache and self.pos_cache[T]
  if not pos then
    self.pos_cache = self.pos_cache or {}
    pos = fsdp.arange(0, T, { dtype = "i64" })
    self.pos_cache[T] = pos
  end
  local chunk = self.head_chunk
  local tok = chunk and fsdp.chunked_embedding(self.wte.weight, idx, { chunk = chunk }) or self.wte(idx)
  local x = tok + self.wpe(pos)                                -- (B, T, C)
  if self.drop then x = self.drop(x) end
  for i = 0, self.h.n - 1 do x = self.h:get(i)(x) end
  x = self.ln_f(x)
  local head = self.lm_head and self.lm_head.weight or self.wte.weight
  if chunk then return chunked_head(self, x, head, targets, B, T) end
  if not keep_logits then return fused_head(self, x, head, targets, B, T) end
  local logits = x:matmul(head, { tb = true })                 -- (B, T, Vp)
  local loss
  if targets then
    local V = self.padded_vocab
    loss = fsdp.cross_entropy(logits:view(B * T, V), targets:view(B * T),
      { ignore_index = -100, valid_vocab = self.vocab_size })
  end
  return logits, loss
end

-- HF's Conv1D layers store (in, out): every Linear weight inside a block.
local function is_conv1d(path)
  return path:match("^h%.%d+%.") and path:match("%.weight$") and
      (path:match("c_attn") or path:match("c_proj") or path:match("c_fc")) ~= nil
end

--- {hf name = tensor} of the model's parameters in HF GPT-2 layout
-- (Conv1D weights transposed, token embedding cut to vocab_size rows).
function GPT:to_hf(sd)
  sd = sd or self:state_dict()
  local out = {}
  for path, t in pairs(sd) do
    if is_conv1d(path) then
      out[path] = t:transpose(1, 2):contiguous()
    elseif path == "wte.weight" then
      out[path] = t:narrow(1, 1, self.vocab_size):contiguous()
    else
      out[path] = t
    end
  end
  return out
end

--- Loads HF-named tensors (as GPT:to_hf writes them, or as a GPT-2
-- safetensors file holds them; a "transformer." prefix is accepted).
function GPT:from_hf(hf)
  local sd = {}
  for name, t in pairs(hf) do
    local path = name:gsub("^transformer%.", "")
    if not fsdp.is_tensor(t) then
      error(string.format("GPT:from_hf: '%s' is a %s, not a tensor", name, type(t)), 2)
    end
    local dt = t:dtype()
    if dt ~= "f32" and dt ~= "bf16" and not path:match("%.attn%.bias$") and not path:match("%.attn%.masked_bias$") then
      error(string.format("GPT:from_hf: '%s' is %s; weights are f32 or bf16", name, t:describe()), 2)
    end
    if path == "lm_head.weight" then
      -- tied to wte: nothing to load
    elseif path:match("%.attn%.bias$") or path:match("%.attn%.masked_bias$") then
      -- HF's causal-mask buffers, not parameters
    elseif is_conv1d(path) then
      sd[path] = t:transpose(1, 2)
    elseif path == "wte.weight" then
      local s = t:shape()
      if s[1] ~= self.vocab_size then
        error(string.format("GPT:from_hf: wte.weight has %d rows, the model's vocab_size is %d", s[1],
          self.vocab_size), 2)
      end
      local full = fsdp.zeros({ self.padded_vocab, s[2] }, { dtype = "f32" })
      full:narrow(1, 1, s[1]):copy(t)
      sd[path] = full
    else
      sd[path] = t
    end
  end
  return self:load_state_dict(sd)
end

--- m:generate(prompt, n, opts) -> a Lua list per row: the prompt (B, T)
-- ids, each row followed by n sampled ids. opts as fsdp.sample.generate:
-- temperature (0.8; 0 = greedy), top_k (40; 0 = off, 1 = greedy), top_p
-- (1 = off), seed (1).
function GPT:generate(prompt, n, opts)
  return require("fsdp.sample").generate(self, prompt, n, opts)
end
M.GPT = GPT

--- Llama{vocab_size=, n_layer=, n_head=, n_embd=, block_size=, hidden=, theta=}:
-- RMSNorm, SwiGLU, rotary positions, no biases, untied head.
local Llama = Module:extend("Llama")
function Llama:__init(cfg)
  local C, proj_std = common_init(self, "Llama", cfg)
  local h = self:add("h", tr.ModuleList())
  local hidden = cfg.hidden or 4 * math.floor(2 * 4 * C / 3 / 4 + 0.5)   -- 2/3 of 4C, as Llama sizes it
  for _ = 1, cfg.n_layer do
    h:append(tr.Block(C, cfg.n_head, {
      norm = "rmsnorm", mlp = "swiglu", bias = false, rotary = true, block_size = cfg.block_size,
      theta = cfg.theta, hidden = hidden, proj_std = proj_std,
    }))
  end
  self:add("ln_f", layers.RMSNorm(C))
  local head = self:add("lm_head", layers.Linear(C, self.padded_vocab, { bias = false }))
  head._vocab_table = true
  if cfg.head_chunk then   -- both tables read by vocabulary chunks: sliced units under fsdp.shard
    head._used_outside_forward, head._slice_rows = true, cfg.head_chunk
    self.wte._used_outside_forward, self.wte._slice_rows = true, cfg.head_chunk
  end
end

function Llama:forward(idx, targets, opts)
  local keep_logits = wants_logits(self, targets, opts)
  local B, T = check_ids(self, idx, "idx")
  local chunk = self.head_chunk
  local x = chunk and fsdp.chunked_embedding(self.wte.weight, idx, { chunk = chunk }) or self.wte(idx)
  for i = 0, self.h.n - 1 do x = self.h:get(i)(x) end
  x = self.ln_f(x)
  if self.head_chunk then return chunked_head(self, x, self.lm_head.weight, targets, B, T) end
  -- The untied lm_head is a module that a wrap policy may make an FSDP unit
  -- of its own, gathered only around its forward: so its logits are always
  -- made there, and { logits = false } only drops them (no fused classifier).
  local logits = self.lm_head(x)
  local loss
  if targets then
    loss = fsdp.cross_entropy(logits:view(B * T, self.padded_vocab), targets:view(B * T),
      { ignore_index = -100, valid_vocab = self.vocab_size })
  end
  if not keep_logits then
    logits:free()   -- nothing else holds them: their memory goes back now
    return nil, loss
  end
  return logits, loss
end
Llama.generate = GPT.generate
M.Llama = Llama

return M
