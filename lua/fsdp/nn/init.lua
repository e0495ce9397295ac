-- fsdp.nn: modules with forward/parameters, in the Torch7 nn style.
local Module = require "fsdp.nn.module"
local layers = require "fsdp.nn.layers"
local tr = require "fsdp.nn.transformer"
local gpt = require "fsdp.nn.gpt"
local checkpoint = require "fsdp.nn.checkpoint"

local nn = {
  Module = Module,
  init = Module.init,
  Linear = layers.Linear,
  Embedding = layers.Embedding,
  LayerNorm = layers.LayerNorm,
  RMSNorm = layers.RMSNorm,
  Dropout = layers.Dropout,
  manual_seed = layers.manual_seed,
  MLP = tr.MLP,
  SwiGLU = tr.SwiGLU,
  CausalSelfAttention = tr.CausalSelfAttention,
  Block = tr.Block,
  ModuleList = tr.ModuleList,
  GPT = gpt.GPT,
  Llama = gpt.Llama,
}

--- nn.checkpoint(module): recompute module's forward during backward.
-- nn.checkpoint(model, "Block") applies it to every module of that type.
function nn.checkpoint(module, type_name)
  if type_name then
    module:apply(function(m) if m.__name == type_name then m._checkpointed = true end end)
  else
    module._checkpointed = true
  end
  return module
end

return nn
