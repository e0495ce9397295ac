-- Basic layers: Linear, Embedding, LayerNorm, RMSNorm, Dropout, the activations
-- (ReLU, GELU, SiLU) and Sequential.
local fsdp = require "fsdp"
local Module = require "fsdp.nn.module"
local options = require "fsdp.options"
local init = Module.init

-- A misspelled option is an error naming the closest one (level: the caller of Class(...)).
local function check(opts, names, what)
  if opts ~= nil then options.check_keys(opts, names, what, 4) end
end

local M = {}

--- Activation modules, no parameters: ReLU(), GELU() (tanh form), SiLU().
for name, fn in pairs { ReLU = "relu", GELU = "gelu", SiLU = "silu" } do
  local Act = Module:extend(name)
  function Act:forward(x) return fsdp[fn](x) end
  M[name] = Act
end

--- Sequential(m1, m2, ...): each module's output is the next one's input;
-- children named "0", "1", ... (as ModuleList, so paths read seq.1.weight).
local Sequential = Module:extend("Sequential")
function Sequential:__init(...)
  self.n = 0
  for i = 1, select("#", ...) do
    local m = select(i, ...)
    if type(m) ~= "table" or type(m.forward) ~= "function" then
      error(string.format("Sequential: argument %d is a %s, not a module", i, type(m)), 3)
    end
    self:add(tostring(self.n), m)
    self.n = self.n + 1
  end
end
function Sequential:forward(x)
  for i = 0, self.n - 1 do x = self[tostring(i)](x) end
  return x
end
M.Sequential = Sequential

--- Linear(in, out, {bias=true, std=0.02}): y = x W^T + b, W (out, in).
local Linear = Module:extend("Linear")
function Linear:__init(n_in, n_out, opts)
  check(opts, { "bias", "std" }, "Linear")
  opts = opts or {}
  self.n_in, self.n_out = n_in, n_out
  self:param("weight", { n_out, n_in }, init.normal(opts.std or 0.02))
  if opts.bias ~= false then self:param("bias", { n_out }, init.zeros()) end
end
-- linear(x, {gelu = true}): gelu(x W^T + b); linear(x, {residual = r}): r + x W^T + b (r of y's shape).
-- One op (fsdp.linear): with a bias, in bf16 on a device with GEMM epilogues one GEMM each way;
-- elsewhere the matmul and one pass for the bias and what follows it (fsdp.bias_gelu, fsdp.bias_residual).
function Linear:forward(x, opts)
  return fsdp.linear(x, self.weight, self.bias, opts)
end
M.Linear = Linear

--- Embedding(n, dim, {std=0.02}): rows of a (n, dim) table by integer ids.
local Embedding = Module:extend("Embedding")
function Embedding:__init(n, dim, opts)
  check(opts, { "std" }, "Embedding")
  self.n, self.dim = n, dim
  self:param("weight", { n, dim }, init.normal(opts and opts.std or 0.02))
end
function Embedding:forward(ids) return fsdp.embedding(self.weight, ids) end
M.Embedding = Embedding

--- LayerNorm(dim, {eps=1e-5, affine=true}) over the last dim.
local LayerNorm = Module:extend("LayerNorm")
function LayerNorm:__init(dim, opts)
  check(opts, { "eps", "affine" }, "LayerNorm")
  self.eps = opts and opts.eps or 1e-5
  if not (opts and opts.affine == false) then
    self:param("weight", { dim }, init.ones())
    self:param("bias", { dim }, init.zeros())
  end
end
function LayerNorm:forward(x) return x:layernorm(self.weight, self.bias, self.eps) end
M.LayerNorm = LayerNorm

--- RMSNorm(dim, {eps=1e-6}) over the last dim.
local RMSNorm = Module:extend("RMSNorm")
function RMSNorm:__init(dim, opts)
  check(opts, { "eps" }, "RMSNorm")
  self.eps = opts and opts.eps or 1e-6
  self:param("weight", { dim }, init.ones())
end
function RMSNorm:forward(x) return x:rmsnorm(self.weight, self.eps) end
M.RMSNorm = RMSNorm

-- Dropout masks come from one counter shared by the process: each call
-- takes the next numel-sized window, so a run is reproducible from its seed
-- and a recomputation (nn.recompute) can rewind the counter.
local rng = { seed = 0, offset = 0 }
M.dropout_rng = rng   -- (for fsdp.nn.recompute, which rewinds it)
function M.manual_seed(seed) rng.seed, rng.offset = seed, 0 end
--- The dropout counter, for a checkpoint: { dropout_seed =, dropout_offset = }.
function M.rng_state() return { dropout_seed = rng.seed, dropout_offset = rng.offset } end
function M.set_rng_state(st)
  if type(st) ~= "table" or type(st.dropout_seed) ~= "number" or type(st.dropout_offset) ~= "number" then
    error("nn.set_rng_state: expected { dropout_seed =, dropout_offset = } (as nn.rng_state gives)", 2)
  end
  rng.seed, rng.offset = st.dropout_seed, st.dropout_offset
end

--- Dropout(p): inverted dropout in training mode, identity in eval mode.
local Dropout = Module:extend("Dropout")
function Dropout:__init(p)
  if type(p) ~= "number" or p < 0 or p >= 1 then
    error("Dropout: p must be a number in [0, 1), got " .. tostring(p), 3)
  end
  self.p = p
end
function Dropout:forward(x)
  if not self.training or self.p == 0 then return x end
  local off = rng.offset
  rng.offset = off + x:numel()
  return x:dropout(self.p, rng.seed, off)
end
M.Dropout = Dropout

return M
