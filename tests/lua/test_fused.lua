-- The fused bias ops (fsdp.bias_gelu, fsdp.bias_residual) on the default
-- device (CUDA's fused kernels under fsdp-lua-emu or on a GPU, the CPU's
-- elsewhere): outputs and gradients against the unfused ops (add, then gelu
-- or add) in f32 on the CPU, the GELU's gradient by finite differences,
-- bf16 against f32, bias gradients added into an existing .grad, the
-- Linear options GPT-2's blocks use, and bad input.
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"

local dev = fsdp.default_device()
local function flat(x) return x:float():cpu():contiguous():view(-1):tolist() end

local close, input, run = t.close_scaled, t.bf16_valued, t.forward_backward

local fused_gelu = function(x, b) return fsdp.bias_gelu(x, b) end
local plain_gelu = function(x, b) return (x + b):gelu() end
local fused_res = function(x, b, r) return fsdp.bias_residual(x, b, r) end
local plain_res = function(x, b, r) return r + (x + b) end

-- shapes: one row, odd (prime) widths, a 16-byte multiple, 3-d
local shapes = { { 1, 1 }, { 3, 7 }, { 5, 8 }, { 2, 3, 13 }, { 17, 64 } }
for _, s in ipairs(shapes) do
  local C = s[#s]
  local tag = table.concat(s, "x")
  local x, b, r = input(1, unpack(s)), input(2, C), input(3, unpack(s))
  local w = input(4, unpack(s))
  -- f32 on the device against the unfused ops on the CPU: the same sums in f32
  local y0, g0 = run(plain_gelu, { x, b }, w, "cpu", "f32")
  local y1, g1 = run(fused_gelu, { x, b }, w, dev, "f32")
  close(y1, y0, 1e-6, "bias_gelu f32 out " .. tag .. " (" .. dev .. ")")
  close(g1[1], g0[1], 1e-5, "bias_gelu f32 dx " .. tag)
  close(g1[2], g0[2], 1e-5, "bias_gelu f32 dbias " .. tag)
  y0, g0 = run(plain_res, { x, b, r }, w, "cpu", "f32")
  y1, g1 = run(fused_res, { x, b, r }, w, dev, "f32")
  close(y1, y0, 0, "bias_residual f32 out " .. tag .. " (" .. dev .. ")")
  close(g1[1], g0[1], 0, "bias_residual f32 dx " .. tag)
  close(g1[2], g0[2], 1e-6, "bias_residual f32 dbias " .. tag)
  close(g1[3], g0[3], 0, "bias_residual f32 dres " .. tag)
  -- bf16 on the device against f32: every value rounded to bf16 once or twice
  y0, g0 = run(plain_gelu, { x, b }, w, "cpu", "f32")
  y1, g1 = run(fused_gelu, { x, b }, w, dev, "bf16")
  t.eq(y1:dtype(), "bf16", "bias_gelu bf16 stays bf16")
  close(y1, y0, 1 / 64, "bias_gelu bf16 out " .. tag)
  close(g1[1], g0[1], 1 / 64, "bias_gelu bf16 dx " .. tag)
  close(g1[2], g0[2], 1 / 64, "bias_gelu bf16 dbias " .. tag)
  y0, g0 = run(plain_res, { x, b, r }, w, "cpu", "f32")
  y1, g1 = run(fused_res, { x, b, r }, w, dev, "bf16")
  close(y1, y0, 1 / 64, "bias_residual bf16 out " .. tag)
  close(g1[2], g0[2], 1 / 64, "bias_residual bf16 dbias " .. tag)
  close(g1[3], g0[3], 1 / 64, "bias_residual bf16 dres " .. tag)
end

-- finite differences of sum(bias_gelu(x, b) * w) in f32: central, step 1e-2
do
  local x, b, w = input(5, 3, 5), input(6, 5), input(7, 3, 5)
  local _, g = run(fused_gelu, { x, b }, w, dev, "f32")
  local function loss(xv, bv) return (fsdp.bias_gelu(xv:to(dev), bv:to(dev)):cpu() * w):sum():item() end
  local h, worst = 1e-2, 0
  local xl, bl = flat(x), flat(b)
  local gx, gb = flat(g[1]), flat(g[2])
  for i = 1, #bl do
    local bp, bm = { unpack(bl) }, { unpack(bl) }
    bp[i], bm[i] = bl[i] + h, bl[i] - h
    local fd = (loss(x, fsdp.tensor(bp, { device = "cpu" })) - loss(x, fsdp.tensor(bm, { device = "cpu" }))) / (2 * h)
    worst = math.max(worst, math.abs(fd - gb[i]))
  end
  for i = 1, #xl, 4 do
    local xp, xm = { unpack(xl) }, { unpack(xl) }
    xp[i], xm[i] = xl[i] + h, xl[i] - h
    local fd = (loss(fsdp.tensor(xp, { device = "cpu" }):view(3, 5), b)
      - loss(fsdp.tensor(xm, { device = "cpu" }):view(3, 5), b)) / (2 * h)
    worst = math.max(worst, math.abs(fd - gx[i]))
  end
  t.ok(worst < 2e-3, string.format("bias_gelu gradients match finite differences (worst %.3g)", worst))
end

-- a bias whose .grad exists gets the new gradient added there (FSDP's gradient slices)
for _, dt in ipairs({ "f32", "bf16" }) do
  local x, b = input(8, 6, 16):to(dev):cast(dt), input(9, 16):to(dev):cast(dt):requires_grad(true)
  fsdp.bias_gelu(x, b):float():sum():backward()
  local once = b:get_grad():float():cpu()
  fsdp.bias_gelu(x, b):float():sum():backward()
  close(b:get_grad(), once * 2, dt == "bf16" and 1 / 128 or 1e-6, "bias_gelu: dbias added into .grad (" .. dt .. ")")
  b:zero_grad()
  fsdp.bias_residual(x, b, x):float():sum():backward()
  once = b:get_grad():float():cpu()
  fsdp.bias_residual(x, b, x):float():sum():backward()
  close(b:get_grad(), once * 2, dt == "bf16" and 1 / 128 or 1e-6, "bias_residual: dbias added into .grad (" .. dt .. ")")
  close(once, fsdp.full({ 16 }, 6, { device = "cpu" }), 0, "bias_residual: dbias = the rows' count (" .. dt .. ")")
end

-- only some inputs need gradients
do
  local x = input(10, 4, 8):to(dev):requires_grad(true)
  local b = input(11, 8):to(dev)
  fsdp.bias_gelu(x, b):sum():backward()
  local _, g = run(plain_gelu, { input(10, 4, 8), input(11, 8) }, fsdp.ones(4, 8, { device = "cpu" }), "cpu", "f32")
  close(x:get_grad(), g[1], 1e-5, "bias_gelu: dx alone (bias without gradient)")
  local xb = input(12, 4, 8):to(dev)
  local bb = input(13, 8):to(dev):requires_grad(true)
  fsdp.bias_gelu(xb, bb):sum():backward()
  _, g = run(plain_gelu, { input(12, 4, 8), input(13, 8) }, fsdp.ones(4, 8, { device = "cpu" }), "cpu", "f32")
  close(bb:get_grad(), g[2], 1e-5, "bias_gelu: dbias alone (x without gradient)")
end

-- the Linear options: {gelu = true} and {residual = r}, with and without a bias
for _, bias in ipairs({ true, false }) do
  local lin = nn.Linear(8, 12, { bias = bias }):materialize { seed = 1 }
  if bias then lin.bias:copy(input(14, 12):to(dev)) end
  local x, r = input(15, 3, 8):to(dev), input(16, 3, 12):to(dev)
  local plain = x:matmul(lin.weight, { tb = true })
  if bias then plain = plain + lin.bias end
  close(lin(x, { gelu = true }), plain:gelu(), 1e-6, "Linear {gelu = true} (bias " .. tostring(bias) .. ")")
  close(lin(x, { residual = r }), r + plain, 1e-6, "Linear {residual = r} (bias " .. tostring(bias) .. ")")
end

-- a GPT-2 block: the fused path equals the same block's unfused ops
do
  local tr = require "fsdp.nn.transformer"
  local blk = tr.Block(16, 2, {}):materialize { seed = 2 }
  local x = input(17, 2, 5, 16):to(dev)
  local y = blk(x)
  local a = blk.attn
  local h = blk.ln_1(x)
  local s = h:shape()
  local qkv = h:matmul(a.c_attn.weight, { tb = true }) + a.c_attn.bias
  local att = fsdp.attention_qkv(qkv, 2, { causal = true })
  local x1 = x + (att:matmul(a.c_proj.weight, { tb = true }) + a.c_proj.bias)
  local m = blk.mlp
  local f = (blk.ln_2(x1):matmul(m.c_fc.weight, { tb = true }) + m.c_fc.bias):gelu()
  local want = x1 + (f:matmul(m.c_proj.weight, { tb = true }) + m.c_proj.bias)
  t.eq(#s, 3, "block input (B, T, C)")
  close(y, want, 1e-6, "Block forward (fused) equals the unfused ops")
end

-- The LayerNorm backward adding its dx into the gradient its input already
-- holds (a residual stream's, under CUDA: layernorm_backward_addx_bf16),
-- against f32 on the CPU: h = 2 x + 1 is not a leaf; in "held" its gradient
-- from h * 3 (recorded after the LayerNorm, so its backward comes first) is
-- its own when the LayerNorm's backward comes; in "shared" the
-- add gives the LayerNorm's output and h the same gradient (the tape must
-- not add into it in place), and "both" takes h through both.
do
  local graphs = {
    { "held", function(x, w, b) local h = x * 2 + 1; local n = h:layernorm(w, b); return n + h * 3 end },
    { "shared", function(x, w, b) local h = x * 2 + 1; return h + h:layernorm(w, b) end },
    { "both", function(x, w, b) local h = x * 2 + 1; return (h * 3 + h:layernorm(w, b)) + h:layernorm(w, b) end },
  }
  for _, s in ipairs({ { 1, 1 }, { 3, 7 }, { 2, 5, 64 }, { 17, 129 } }) do
    local C = s[#s]
    local tag = table.concat(s, "x")
    local x, w, b, wo = input(11, unpack(s)), input(12, C), input(13, C), input(14, unpack(s))
    for _, g in ipairs(graphs) do
      local name, fn = g[1], g[2]
      local y0, g0 = run(fn, { x, w, b }, wo, "cpu", "f32")
      local y1, g1 = run(fn, { x, w, b }, wo, dev, "bf16")
      close(y1, y0, 1 / 32, "layernorm " .. name .. " bf16 out " .. tag .. " (" .. dev .. ")")
      close(g1[1], g0[1], 1 / 32, "layernorm " .. name .. " bf16 dx " .. tag)
      close(g1[2], g0[2], 1 / 32, "layernorm " .. name .. " bf16 dweight " .. tag)
      close(g1[3], g0[3], 1 / 32, "layernorm " .. name .. " bf16 dbias " .. tag)
    end
  end
end

-- bad input: a clear error naming the op and the tensors
local x, b = fsdp.zeros(3, 4), fsdp.zeros(4)
t.raises(function() return fsdp.bias_gelu(x, fsdp.zeros(5)) end, { "fsdp_bias_gelu", "bias", "[5]", "last dim of x" },
  "bias_gelu: a bias of the wrong length")
t.raises(function() return fsdp.bias_gelu(x, fsdp.zeros(1, 4)) end, { "fsdp_bias_gelu", "1-D" },
  "bias_gelu: a 2-D bias")
t.raises(function() return fsdp.bias_gelu(x, b:bf16()) end, { "fsdp_bias_gelu", "dtypes differ" },
  "bias_gelu: dtypes differ")
t.raises(function() return fsdp.bias_gelu(fsdp.zeros(3, 4, { dtype = "i64" }), b) end,
  { "fsdp_bias_gelu", "f32 or bf16" }, "bias_gelu: an integer x")
t.raises(function() return fsdp.bias_residual(x, b, fsdp.zeros(4, 3)) end,
  { "fsdp_bias_residual", "res", "[4,3]", "shape of x" }, "bias_residual: res of another shape")
t.raises(function() return fsdp.bias_residual(x, b, nil) end, { "bias_residual" }, "bias_residual: no res")
if dev ~= "cpu" then
  t.raises(function() return fsdp.bias_gelu(x, b:cpu()) end, { "fsdp_bias_gelu", "different devices" },
    "bias_gelu: tensors on two devices")
end

t.done()
