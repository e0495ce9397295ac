-- fsdp.nn: modules with forward/parameters, in the Torch7 nn style.
local Module = require "fsdp.nn.module"
local layers = require "fsdp.nn.layers"
local tr = require "fsdp.nn.transformer"
local gpt = require "fsdp.nn.gpt"

local nn = {
  Module = Module,
  init = Module.init,
  Linear = layers.Linear,
  Embedding = layers.Embedding,
  LayerNorm = layers.LayerNorm,
  RMSNorm = layers.RMSNorm,
  Dropout = layers.Dropout,
  ReLU = layers.ReLU,
  GELU = layers.GELU,
  SiLU = layers.SiLU,
  Sequential = layers.Sequential,
  manual_seed = layers.manual_seed,
  rng_state = layers.rng_state,
  set_rng_state = layers.set_rng_state,
  MLP = tr.MLP,
  SwiGLU = tr.SwiGLU,
  CausalSelfAttention = tr.CausalSelfAttention,
  Block = tr.Block,
  ModuleList = tr.ModuleList,
  GPT = gpt.GPT,
  Llama = gpt.Llama,
  gpt_preset = gpt.preset,           -- nn.gpt_preset("tiny" | "small") -> config
  gpt_preset_names = gpt.preset_names,
}

--- nn.recompute(module): keep no activations of module's forward; run it
-- again during backward (activation recomputation, fsdp.nn.recompute).
-- nn.recompute(model, "Block") marks every module of that type.
function nn.recompute(module, type_name)
  if type_name then
    module:apply(function(m) if m.__name == type_name then m._recompute = true end end)
  else
    module._recompute = true
  end
  return module
end

return nn
