-- Transformer parts: MLP (GELU), SwiGLU, CausalSelfAttention (fused qkv,
-- optional rotary embedding) and the pre-norm Block.
local fsdp = require "fsdp"
local Module = require "fsdp.nn.module"
local layers = require "fsdp.nn.layers"
local init = Module.init

local M = {}

--- MLP(dim, {hidden=4*dim, proj_std=0.02, bias=true}): c_fc, GELU (tanh), c_proj.
local MLP = Module:extend("MLP")
function MLP:__init(dim, opts)
  opts = opts or {}
  local hidden = opts.hidden or 4 * dim
  self:add("c_fc", layers.Linear(dim, hidden, { bias = opts.bias }))
  self:add("c_proj", layers.Linear(hidden, dim, { bias = opts.bias, std = opts.proj_std }))
end
-- A Linear called on its own: its forward wrapped (an FSDP unit of its own) or recomputed.
local function own_call(lin) return rawget(lin, "forward") ~= nil or lin._recompute end
-- mlp(x, res): res + mlp(x). One op (fsdp.mlp: with GEMM epilogues, the GELU's
-- backward rides on c_proj's dx GEMM) unless c_fc or c_proj must be called on its own.
function MLP:forward(x, res)
  local fc, proj = self.c_fc, self.c_proj
  if own_call(fc) or own_call(proj) then return proj(fc(x, { gelu = true }), { residual = res }) end
  return fsdp.mlp(x, fc.weight, fc.bias, proj.weight, proj.bias, { residual = res })
end
M.MLP = MLP

--- SwiGLU(dim, {hidden=, proj_std=}): w2(silu(w1 x) * w3 x), no biases.
local SwiGLU = Module:extend("SwiGLU")
function SwiGLU:__init(dim, opts)
  opts = opts or {}
  local hidden = opts.hidden or 4 * dim
  self:add("w1", layers.Linear(dim, hidden, { bias = false }))
  self:add("w3", layers.Linear(dim, hidden, { bias = false }))
  self:add("w2", layers.Linear(hidden, dim, { bias = false, std = opts.proj_std }))
end
function SwiGLU:forward(x, res) return self.w2(self.w1(x):silu() * self.w3(x), { residual = res }) end
M.SwiGLU = SwiGLU

-- Rotary embedding, rotate-half form: x cos + rotate_half(x) sin, where
-- rotate_half(x) = (-x2, x1) for the two halves of the head dim. The
-- rotation is a fixed (D, D) matrix of +-1, so it is one matmul and the
-- engine's matmul backward differentiates it.
local function rotary_tables(max_t, d, theta)
  local half = d / 2
  local cos, sin, rot = {}, {}, {}
  for t = 0, max_t - 1 do
    for j = 0, d - 1 do
      local freq = theta ^ (-2 * (j % half) / d)
      cos[#cos + 1] = math.cos(t * freq)
      sin[#sin + 1] = math.sin(t * freq)
    end
  end
  for r = 0, d - 1 do
    for c = 0, d - 1 do
      local v = 0
      if c < half and r == c + half then v = -1 end
      if c >= half and r == c - half then v = 1 end
      rot[#rot + 1] = v
    end
  end
  return fsdp.tensor(cos, { max_t, d }), fsdp.tensor(sin, { max_t, d }), fsdp.tensor(rot, { d, d })
end

--- CausalSelfAttention(dim, n_head, {bias=true, rotary=false, block_size=, theta=10000, proj_std=})
local Attention = Module:extend("CausalSelfAttention")
function Attention:__init(dim, n_head, opts)
  opts = opts or {}
  if dim % n_head ~= 0 then
    error(string.format("CausalSelfAttention: width %d is not divisible by %d heads", dim, n_head), 3)
  end
  self.dim, self.n_head, self.head_dim = dim, n_head, dim / n_head
  self:add("c_attn", layers.Linear(dim, 3 * dim, { bias = opts.bias }))
  self:add("c_proj", layers.Linear(dim, dim, { bias = opts.bias, std = opts.proj_std }))
  if opts.rotary then
    if self.head_dim % 2 ~= 0 then error("CausalSelfAttention: rotary needs an even head dim", 3) end
    self.rotary = { block_size = assert(opts.block_size, "rotary needs block_size"), theta = opts.theta or 10000 }
  end
end

-- One set of tables per (length, head dim, theta, device), shared by every
-- layer (a table per layer cost 32 x 4 MiB at 4096 x 128); weak, so the
-- tables go when no model holds them.
local rotary_cache = setmetatable({}, { __mode = "v" })

function Attention:rope(x, T)
  local r = self.rotary
  if not r.cos then
    local key = string.format("%d/%d/%.17g/%s", r.block_size, self.head_dim, r.theta, fsdp.default_device())
    local tabs = rotary_cache[key]
    if not tabs then
      tabs = { rotary_tables(r.block_size, self.head_dim, r.theta) }
      rotary_cache[key] = tabs
    end
    r.tables = tabs   -- (held here, so the cache's weak entry lives as long as a layer uses it)
    r.cos, r.sin, r.rot = tabs[1], tabs[2], tabs[3]
  end
  local dt = x:dtype()
  local cos, sin, rot = r.cos:narrow(1, 1, T), r.sin:narrow(1, 1, T), r.rot
  if dt ~= "f32" then cos, sin, rot = cos:cast(dt), sin:cast(dt), rot:cast(dt) end
  return x * cos + x:matmul(rot) * sin
end

-- attn(x, res): res + attn(x), the residual added by c_proj's bias pass
function Attention:forward(x, res)
  local s = x:shape()
  local B, T, C = s[1], s[2], s[3]
  local H, D = self.n_head, self.head_dim
  local proj = { residual = res }
  if not self.rotary then   -- straight from the packed projection: no split or permute copies
    return self.c_proj(fsdp.attention_qkv(self.c_attn(x), H, { causal = true }), proj)   -- (B, T, C)
  end
  local qkv = self.c_attn(x):view(B, T, 3, H, D):permute(3, 1, 4, 2, 5)   -- (3, B, H, T, D)
  local q = qkv:narrow(1, 1, 1):reshape(B, H, T, D)
  local k = qkv:narrow(1, 2, 1):reshape(B, H, T, D)
  local v = qkv:narrow(1, 3, 1):reshape(B, H, T, D)
  q, k = self:rope(q, T), self:rope(k, T)
  local y = fsdp.attention(q, k, v, { causal = true })                 -- (B, H, T, D)
  y = y:permute(1, 3, 2, 4):reshape(B, T, C)
  return self.c_proj(y, proj)
end
M.CausalSelfAttention = Attention

--- Block(dim, n_head, opts): pre-norm residual block.
-- opts.norm = "layernorm" | "rmsnorm", opts.mlp = "gelu" | "swiglu", and
-- the attention options; opts.dropout applies to both residual branches.
local Block = Module:extend("Block")
function Block:__init(dim, n_head, opts)
  opts = opts or {}
  require("fsdp.options").check_keys(opts, { "norm", "mlp", "bias", "rotary", "block_size", "theta", "hidden",
    "proj_std", "dropout", "eps" }, "Block", 3)
  local Norm = opts.norm == "rmsnorm" and layers.RMSNorm or layers.LayerNorm
  self:add("ln_1", Norm(dim, { eps = opts.eps }))
  self:add("attn", Attention(dim, n_head, opts))
  self:add("ln_2", Norm(dim, { eps = opts.eps }))
  if opts.mlp == "swiglu" then
    self:add("mlp", SwiGLU(dim, { hidden = opts.hidden, proj_std = opts.proj_std }))
  else
    self:add("mlp", MLP(dim, { hidden = opts.hidden, proj_std = opts.proj_std, bias = opts.bias }))
  end
  if opts.dropout and opts.dropout > 0 then self:add("drop", layers.Dropout(opts.dropout)) end
end
function Block:forward(x)
  if not self.drop then   -- the residual adds ride on the projections' bias passes
    x = self.attn(self.ln_1(x), x)
    return self.mlp(self.ln_2(x), x)
  end
  local a = self.attn(self.ln_1(x))
  if self.drop then a = self.drop(a) end
  x = x + a
  local m = self.mlp(self.ln_2(x))
  if self.drop then m = self.drop(m) end
  return x + m
end
M.Block = Block

--- ModuleList: children named "0", "1", ... (paths like h.3.attn).
local ModuleList = Module:extend("ModuleList")
function ModuleList:__init(list)
  self.n = 0
  for _, m in ipairs(list or {}) do self:append(m) end
end
function ModuleList:append(m)
  self:add(tostring(self.n), m)
  self.n = self.n + 1
  return m
end
function ModuleList:get(i) return self[tostring(i)] end   -- 0-based, as the paths
M.ModuleList = ModuleList

return M
