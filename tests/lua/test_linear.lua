-- fsdp.linear, a Linear as one op (y = [r +] act(x W^T + b)), on the
-- default device (CUDA under fsdp-lua-emu or on a GPU: bf16 with a bias is
-- one GEMM with an epilogue each way; the CPU elsewhere: the composition it
-- replaces): against that composition (bit for bit where it is the path),
-- against f32 on the CPU (bf16 within a stated tolerance), the gradients by
-- finite differences in f32, awkward sizes, gradients added over two
-- backwards, only some inputs needing gradients, the kernels it runs (the
-- counting device mimicking CUDA), and bad input.
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local meta = require "fsdp.meta"

local dev = fsdp.default_device()
local function flat(x) return x:float():cpu():contiguous():view(-1):tolist() end
local close, input, run = t.close_scaled, t.bf16_valued, t.forward_backward

-- the composition fsdp.linear replaces (the old Linear:forward), op for op
local function composed(opts)
  return function(x, w, b, r)
    local y = x:matmul(w, { tb = true })
    if b then
      if opts.gelu then y = fsdp.bias_gelu(y, b)
      elseif opts.residual then return fsdp.bias_residual(y, b, r)
      else y = y + b end
    elseif opts.gelu then
      y = y:gelu()
    end
    if opts.residual then y = r + y end
    return y
  end
end
-- the same from the basic ops only (an independent reference)
local function plain(opts)
  return function(x, w, b, r)
    local y = x:matmul(w, { tb = true })
    if b then y = y + b end
    if opts.gelu then y = y:gelu() end
    if opts.residual then y = r + y end
    return y
  end
end
-- bounds for the bf16 checks: the same sums over the absolute values of
-- every term (gelu' is at most 1.13), so that a value that cancels to near
-- zero is held to the rounding of its terms, not to its own size
local function magnitudes(opts)
  return function(x, w, b, r)
    local y = x:matmul(w, { tb = true })
    if b then y = y + b end
    if opts.gelu then y = y * 1.13 end
    if opts.residual then y = r + y end
    return y
  end
end
local function abs_of(v)
  local a = flat(v)
  for i = 1, #a do a[i] = math.abs(a[i]) end
  return fsdp.tensor(a, v:shape(), { device = "cpu" })
end
local function abs_all(list)
  local out = {}
  for i, v in ipairs(list) do out[i] = abs_of(v) end
  return out
end
-- max |got - want| <= tol * max(bound) over all elements
local function close_to(got, want, bound, tol, name)
  local g, w, m, e = flat(got), flat(want), 0, 0
  if #g ~= #w then return t.ok(false, name .. ": sizes differ") end
  for _, v in ipairs(flat(bound)) do m = math.max(m, math.abs(v)) end
  for i = 1, #w do
    local d = math.abs(g[i] - w[i])
    if d ~= d then d = math.huge end
    e = math.max(e, d)
  end
  return t.ok(e <= tol * math.max(m, 1e-6), string.format("%s: max err %.3g, tol %.3g x %.3g", name, e, tol, m))
end
local function fused(opts)
  return function(x, w, b, r)
    return fsdp.linear(x, w, b, { gelu = opts.gelu, residual = opts.residual and r or nil })
  end
end

local function same_bits(a, b)
  local x, y = flat(a), flat(b)
  if #x ~= #y then return false end
  for i = 1, #x do
    if x[i] ~= y[i] then return false end
  end
  return true
end

local modes = {
  { name = "plain", opts = {} },
  { name = "gelu", opts = { gelu = true } },
  { name = "residual", opts = { residual = true } },
  { name = "gelu+residual", opts = { gelu = true, residual = true } },
}
-- x's leading dims, in, out: a row of one, widths of 1, odd and prime, a 16-byte multiple, 3-d
local shapes = { { { 1 }, 1, 1 }, { { 1 }, 5, 3 }, { { 3 }, 7, 13 }, { { 2, 3 }, 13, 1 }, { { 17 }, 8, 16 },
  { { 2, 5 }, 16, 24 }, { { 5 }, 1, 7 } }

for _, s in ipairs(shapes) do
  local lead, n_in, n_out = s[1], s[2], s[3]
  local xs, ys = { unpack(lead) }, { unpack(lead) }
  xs[#xs + 1], ys[#ys + 1] = n_in, n_out
  local tag = table.concat(xs, "x") .. "->" .. n_out
  local x, w, b, r = input(1, unpack(xs)), input(2, n_out, n_in), input(3, n_out), input(4, unpack(ys))
  local wo = input(5, unpack(ys))
  for _, m in ipairs(modes) do
    for _, with_bias in ipairs({ true, false }) do
      local name = string.format("linear %s%s %s", m.name, with_bias and "" or " (no bias)", tag)
      -- the inputs in fixed places: b unused without a bias, r without a residual
      local function args(fn)
        return function(xv, wv, bv, rv) return fn(xv, wv, with_bias and bv or nil, rv) end
      end
      local list = { x, w, b, r }
      -- f32: the composition itself on every device (bit for bit)
      local y0, g0 = run(args(composed(m.opts)), list, wo, dev, "f32")
      local y1, g1 = run(args(fused(m.opts)), list, wo, dev, "f32")
      local same = same_bits(y1, y0)
      for i = 1, 4 do
        local need = (i ~= 3 or with_bias) and (i ~= 4 or m.opts.residual)
        if need then same = same and g1[i] ~= nil and same_bits(g1[i], g0[i]) end
      end
      t.ok(same, name .. " f32: the composition's values and gradients, bit for bit (" .. dev .. ")")
      -- f32 against the basic ops on the CPU
      local yp, gp = run(args(plain(m.opts)), list, wo, "cpu", "f32")
      close(y1, yp, 1e-5, name .. " f32 out vs the basic ops")
      close(g1[1], gp[1], 1e-5, name .. " f32 dx vs the basic ops")
      close(g1[2], gp[2], 1e-5, name .. " f32 dW vs the basic ops")
      if with_bias then close(g1[3], gp[3], 1e-5, name .. " f32 db vs the basic ops") end
      -- bf16 on the device against f32 on the CPU: inputs exact in bf16, one
      -- rounding of each output and gradient (two for the GELU's input, the
      -- bias sums and the residual's sum)
      local yb, gb = run(args(fused(m.opts)), list, wo, dev, "bf16")
      local ya, ga = run(args(magnitudes(m.opts)), abs_all(list), abs_of(wo), "cpu", "f32")
      t.eq(yb:dtype(), "bf16", name .. " bf16 stays bf16")
      close_to(yb, yp, ya, 1 / 64, name .. " bf16 out (" .. dev .. ")")
      close_to(gb[1], gp[1], ga[1], 1 / 64, name .. " bf16 dx")
      close_to(gb[2], gp[2], ga[2], 1 / 64, name .. " bf16 dW")
      if with_bias then close_to(gb[3], gp[3], ga[3], 1 / 64, name .. " bf16 db") end
      if m.opts.residual then close_to(gb[4], gp[4], ga[4], 1 / 128, name .. " bf16 dres") end
      if dev == "cpu" then   -- the CPU runs the composition in bf16 too
        local yc, gc = run(args(composed(m.opts)), list, wo, dev, "bf16")
        local eq = same_bits(yb, yc) and same_bits(gb[1], gc[1]) and same_bits(gb[2], gc[2])
        if with_bias then eq = eq and same_bits(gb[3], gc[3]) end
        t.ok(eq, name .. " bf16 on the CPU: the composition bit for bit")
      end
    end
  end
end

-- finite differences of sum(linear(x, W, b, {gelu}) * wo) in f32: central, step 1e-2
do
  local x, w, b, wo = input(6, 3, 4), input(7, 5, 4), input(8, 5), input(9, 3, 5)
  local lin = function(xv, wv, bv) return fsdp.linear(xv, wv, bv, { gelu = true }) end
  local _, g = run(lin, { x, w, b }, wo, dev, "f32")
  local function loss(xv, wv, bv) return (lin(xv:to(dev), wv:to(dev), bv:to(dev)):cpu() * wo):sum():item() end
  local h, worst = 1e-2, 0
  local vals = { flat(x), flat(w), flat(b) }
  local grads = { flat(g[1]), flat(g[2]), flat(g[3]) }
  local shapes_of = { { 3, 4 }, { 5, 4 }, { 5 } }
  for k = 1, 3 do
    for i = 1, #vals[k] do
      local p, q = { unpack(vals[k]) }, { unpack(vals[k]) }
      p[i], q[i] = vals[k][i] + h, vals[k][i] - h
      local a = { x, w, b }
      local c = { x, w, b }
      a[k] = fsdp.tensor(p, shapes_of[k], { device = "cpu" })
      c[k] = fsdp.tensor(q, shapes_of[k], { device = "cpu" })
      local fd = (loss(a[1], a[2], a[3]) - loss(c[1], c[2], c[3])) / (2 * h)
      worst = math.max(worst, math.abs(fd - grads[k][i]))
    end
  end
  t.ok(worst < 2e-3, string.format("linear gelu: dx, dW, db match finite differences (worst %.3g)", worst))
end

-- weights and biases whose .grad exists get the second backward's gradient added
for _, dt in ipairs({ "f32", "bf16" }) do
  for _, m in ipairs({ { gelu = true }, {}, { residual = true } }) do
    local x = input(10, 6, 16):to(dev):cast(dt)
    local r = input(11, 6, 8):to(dev):cast(dt)
    local w = input(12, 8, 16):to(dev):cast(dt):requires_grad(true)
    local b = input(13, 8):to(dev):cast(dt):requires_grad(true)
    local function step()
      fsdp.linear(x, w, b, { gelu = m.gelu, residual = m.residual and r or nil }):float():sum():backward()
    end
    step()
    local gw, gb = w:get_grad():float():cpu(), b:get_grad():float():cpu()
    step()
    local tol = dt == "bf16" and 1 / 128 or 1e-6
    local what = (m.gelu and "gelu" or m.residual and "residual" or "plain") .. " " .. dt
    close(w:get_grad(), gw * 2, tol, "linear " .. what .. ": dW added into .grad")
    close(b:get_grad(), gb * 2, tol, "linear " .. what .. ": db added into .grad")
    if not m.gelu then   -- d sum / d b is the count of rows
      close(gb, fsdp.full({ 8 }, 6, { device = "cpu" }), 0, "linear " .. what .. ": db = the rows' count")
    end
  end
end

-- only some inputs need gradients
for _, dt in ipairs({ "f32", "bf16" }) do
  local x0, w0, b0, wo = input(14, 4, 6), input(15, 3, 6), input(16, 3), input(17, 4, 3)
  local _, want = run(plain({ gelu = true }), { x0, w0, b0 }, wo, "cpu", "f32")
  local tol = dt == "bf16" and 1 / 32 or 1e-5
  for k, which in ipairs({ "x", "weight", "bias" }) do
    local v = { x0:to(dev):cast(dt), w0:to(dev):cast(dt), b0:to(dev):cast(dt) }
    v[k] = v[k]:requires_grad(true)
    ;(fsdp.linear(v[1], v[2], v[3], { gelu = true }):float() * wo:to(dev)):sum():backward()
    close(v[k]:get_grad(), want[k], tol, "linear gelu " .. dt .. ": d" .. which .. " alone")
    for j = 1, 3 do
      if j ~= k then t.ok(v[j]:get_grad() == nil, "linear gelu " .. dt .. ": no gradient for " .. j .. " with d" .. which) end
    end
  end
end

-- nn.Linear over it: the options GPT-2's blocks use, with and without a bias
for _, bias in ipairs({ true, false }) do
  local lin = nn.Linear(8, 12, { bias = bias }):materialize { seed = 1 }
  if bias then lin.bias:copy(input(18, 12):to(dev)) end
  local x, r = input(19, 3, 8):to(dev), input(20, 3, 12):to(dev)
  local p = x:matmul(lin.weight, { tb = true })
  if bias then p = p + lin.bias end
  close(lin(x), p, 1e-6, "Linear (bias " .. tostring(bias) .. ")")
  close(lin(x, { gelu = true }), p:gelu(), 1e-6, "Linear {gelu = true} (bias " .. tostring(bias) .. ")")
  close(lin(x, { residual = r }), r + p, 1e-6, "Linear {residual = r} (bias " .. tostring(bias) .. ")")
  close(lin(x, { gelu = true, residual = r }), r + p:gelu(), 1e-6,
    "Linear {gelu = true, residual = r} (bias " .. tostring(bias) .. ")")
end

-- the kernels it runs: the counting device with CUDA's kernel set

if pcall(meta.mimic, "cuda") and meta.by_name().matmul_epilogue_bf16 and meta.by_name().matmul_epilogue_bf16.present then
  local M, K, N = 6, 16, 8
  local function counts(opts, bias)
    local x = fsdp.randn(M, K, { seed = 1, device = "meta" }):cast("bf16"):requires_grad(true)
    local w = fsdp.randn(N, K, { seed = 2, device = "meta" }):cast("bf16"):requires_grad(true)
    local b = bias and fsdp.randn(N, { seed = 3, device = "meta" }):cast("bf16"):requires_grad(true) or nil
    local r = opts.residual and fsdp.randn(M, N, { seed = 4, device = "meta" }):cast("bf16"):requires_grad(true)
    meta.reset()
    local y = fsdp.linear(x, w, b, { gelu = opts.gelu, residual = r or nil })
    local f = meta.by_name()
    local fwd = { epi = f.matmul_epilogue_bf16.calls, mm = f.matmul_bf16.calls,
      other = f.bias_gelu_forward_bf16.calls + f.bias_residual_bf16.calls + f.binary_bf16.calls }
    meta.reset()
    y:backward(fsdp.ones(M, N, { device = "meta" }):cast("bf16"))
    local e = meta.by_name()
    return fwd, { epi = e.matmul_epilogue_bf16.calls, mm = e.matmul_bf16.calls, sum = e.sum_dim_bf16.calls,
      gelu = e.gelu_backward_bf16.calls + e.bias_gelu_backward_bf16.calls }
  end
  for _, m in ipairs({ { name = "plain", opts = {} }, { name = "gelu", opts = { gelu = true } },
    { name = "residual", opts = { residual = true } } }) do
    local f, b = counts(m.opts, true)
    t.ok(f.epi == 1 and f.mm == 0 and f.other == 0, "CUDA set, " .. m.name .. ": forward is one epilogue GEMM")
    t.ok(b.epi == 1 and b.mm == 1 and b.sum == 0, "CUDA set, " .. m.name ..
      ": backward is dx and dW GEMMs, the bias gradient in dW's epilogue")
    t.eq(b.gelu, m.opts.gelu and 1 or 0, "CUDA set, " .. m.name .. ": one GELU backward pass where there is a GELU")
  end
  local f = counts({}, false)
  t.ok(f.epi == 0 and f.mm == 1, "CUDA set, no bias: the plain GEMM (the composition)")
  f = counts({ gelu = true, residual = true }, true)
  t.ok(f.epi == 0 and f.mm == 1, "CUDA set, gelu with residual: the composition")
end
meta.mimic("cpu")

-- ---- fsdp.mlp: y = [r +] gelu(x W1^T + b1) W2^T + b2, one node ----

local function mlp_composed(x, w1, b1, w2, b2, r)   -- two fsdp.linear (what it runs where it does not fuse)
  return fsdp.linear(fsdp.linear(x, w1, b1, { gelu = true }), w2, b2, { residual = r })
end
local function mlp_plain(x, w1, b1, w2, b2, r)   -- the basic ops
  local h = x:matmul(w1, { tb = true })
  if b1 then h = h + b1 end
  local y = h:gelu():matmul(w2, { tb = true })
  if b2 then y = y + b2 end
  if r then y = r + y end
  return y
end
local function mlp_magnitudes(x, w1, b1, w2, b2, r)   -- |gelu(v)| <= |v|, |gelu'(v)| <= 1.13
  local h = x:matmul(w1, { tb = true })
  if b1 then h = h + b1 end
  local y = (h * 1.13):matmul(w2, { tb = true })
  if b2 then y = y + b2 end
  if r then y = r + y end
  return y
end
local mlp_fused = function(x, w1, b1, w2, b2, r) return fsdp.mlp(x, w1, b1, w2, b2, { residual = r }) end

-- x's leading dims, in, hidden, out
local mlp_shapes = { { { 1 }, 1, 1, 1 }, { { 3 }, 5, 8, 7 }, { { 2, 3 }, 7, 16, 5 }, { { 17 }, 8, 24, 8 },
  { { 1 }, 16, 8, 16 }, { { 4 }, 3, 13, 2 } }
local bias_sets = { { true, true, "biases" }, { false, false, "no biases" }, { true, false, "b_fc only" },
  { false, true, "b_proj only" } }
for _, s in ipairs(mlp_shapes) do
  local lead, C, H, N = s[1], s[2], s[3], s[4]
  local xs, ys = { unpack(lead) }, { unpack(lead) }
  xs[#xs + 1], ys[#ys + 1] = C, N
  local tag = table.concat(xs, "x") .. "->" .. H .. "->" .. N
  local list = { input(21, unpack(xs)), input(22, H, C), input(23, H), input(24, N, H), input(25, N),
    input(26, unpack(ys)) }
  local wo = input(27, unpack(ys))
  for _, with_res in ipairs({ true, false }) do
    for _, bs in ipairs(bias_sets) do
      local name = string.format("mlp %s%s %s", bs[3], with_res and " + residual" or "", tag)
      local function args(fn)
        return function(x, w1, b1, w2, b2, r)
          return fn(x, w1, bs[1] and b1 or nil, w2, bs[2] and b2 or nil, with_res and r or nil)
        end
      end
      local used = { true, true, bs[1], true, bs[2], with_res }
      local y0, g0 = run(args(mlp_composed), list, wo, dev, "f32")
      local y1, g1 = run(args(mlp_fused), list, wo, dev, "f32")
      local same = same_bits(y1, y0)
      for i = 1, 6 do
        if used[i] then same = same and g1[i] ~= nil and same_bits(g1[i], g0[i]) end
      end
      t.ok(same, name .. " f32: two fsdp.linear's values and gradients, bit for bit (" .. dev .. ")")
      local yp, gp = run(args(mlp_plain), list, wo, "cpu", "f32")
      close(y1, yp, 1e-5, name .. " f32 out vs the basic ops")
      for i = 1, 6 do
        if used[i] then close(g1[i], gp[i], 1e-5, name .. " f32 grad " .. i .. " vs the basic ops") end
      end
      -- bf16 on the device against f32 on the CPU, held to the terms' magnitudes
      local yb, gb = run(args(mlp_fused), list, wo, dev, "bf16")
      local ya, ga = run(args(mlp_magnitudes), abs_all(list), abs_of(wo), "cpu", "f32")
      t.eq(yb:dtype(), "bf16", name .. " bf16 stays bf16")
      close_to(yb, yp, ya, 1 / 64, name .. " bf16 out (" .. dev .. ")")
      local what = { "dx", "dW_fc", "db_fc", "dW_proj", "db_proj", "dres" }
      for i = 1, 6 do
        if used[i] then close_to(gb[i], gp[i], ga[i], 1 / 64, name .. " bf16 " .. what[i]) end
      end
      if dev == "cpu" then
        local yc, gc = run(args(mlp_composed), list, wo, dev, "bf16")
        local eq = same_bits(yb, yc)
        for i = 1, 6 do
          if used[i] then eq = eq and same_bits(gb[i], gc[i]) end
        end
        t.ok(eq, name .. " bf16 on the CPU: two fsdp.linear bit for bit")
      end
    end
  end
end

-- finite differences of sum(mlp(...) * wo) in f32, every input
do
  local list = { input(28, 2, 3), input(29, 4, 3), input(30, 4), input(31, 2, 4), input(32, 2), input(33, 2, 2) }
  local wo = input(34, 2, 2)
  local _, g = run(mlp_fused, list, wo, dev, "f32")
  local function loss(v)
    local d = {}
    for i = 1, 6 do d[i] = v[i]:to(dev) end
    return (mlp_fused(unpack(d)):cpu() * wo):sum():item()
  end
  local h, worst = 1e-2, 0
  for k = 1, 6 do
    local vals, gk = flat(list[k]), flat(g[k])
    for i = 1, #vals do
      local p, q = { unpack(vals) }, { unpack(vals) }
      p[i], q[i] = vals[i] + h, vals[i] - h
      local a, c = { unpack(list) }, { unpack(list) }
      a[k] = fsdp.tensor(p, list[k]:shape(), { device = "cpu" })
      c[k] = fsdp.tensor(q, list[k]:shape(), { device = "cpu" })
      worst = math.max(worst, math.abs((loss(a) - loss(c)) / (2 * h) - gk[i]))
    end
  end
  t.ok(worst < 2e-3, string.format("mlp: every gradient matches finite differences (worst %.3g)", worst))
end

-- gradients added over two backwards, and only some inputs needing them
for _, dt in ipairs({ "f32", "bf16" }) do
  local base = { input(35, 6, 16), input(36, 24, 16), input(37, 24), input(38, 8, 24), input(39, 8), input(40, 6, 8) }
  local v = {}
  for i = 1, 6 do v[i] = base[i]:to(dev):cast(dt) end
  for i = 2, 5 do v[i] = v[i]:requires_grad(true) end
  local function step() fsdp.mlp(v[1], v[2], v[3], v[4], v[5], { residual = v[6] }):float():sum():backward() end
  step()
  local once = {}
  for i = 2, 5 do once[i] = v[i]:get_grad():float():cpu() end
  step()
  local tol = dt == "bf16" and 1 / 128 or 1e-6
  for i = 2, 5 do close(v[i]:get_grad(), once[i] * 2, tol, "mlp " .. dt .. ": gradient " .. i .. " added into .grad") end
  close(once[5], fsdp.full({ 8 }, 6, { device = "cpu" }), 0, "mlp " .. dt .. ": db_proj = the rows' count")

  local wo = input(41, 6, 8)
  local _, want = run(mlp_plain, base, wo, "cpu", "f32")
  local ya, ga = run(mlp_magnitudes, abs_all(base), abs_of(wo), "cpu", "f32")
  for k = 1, 6 do
    local u = {}
    for i = 1, 6 do u[i] = base[i]:to(dev):cast(dt) end
    u[k] = u[k]:requires_grad(true)
    ;(fsdp.mlp(u[1], u[2], u[3], u[4], u[5], { residual = u[6] }):float() * wo:to(dev)):sum():backward()
    local none = true
    for j = 1, 6 do
      if j ~= k then none = none and u[j]:get_grad() == nil end
    end
    t.ok(none, "mlp " .. dt .. ": only input " .. k .. " gets a gradient")
    if dt == "bf16" then close_to(u[k]:get_grad(), want[k], ga[k], 1 / 64, "mlp bf16: gradient " .. k .. " alone")
    else close(u[k]:get_grad(), want[k], 1e-5, "mlp f32: gradient " .. k .. " alone") end
  end
end

-- nn.MLP over it, and over its Linears when one of them must be called on its own
do
  local tr = require "fsdp.nn.transformer"
  local mlp = tr.MLP(8, { hidden = 16 }):materialize { seed = 3 }
  mlp.c_fc.bias:copy(input(42, 16):to(dev))
  mlp.c_proj.bias:copy(input(43, 8):to(dev))
  local x, r = input(44, 3, 8):to(dev), input(45, 3, 8):to(dev)
  local want = mlp_plain(x, mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias, r)
  close(mlp(x, r), want, 1e-6, "MLP(x, res): fsdp.mlp")
  local calls = 0
  local fc = mlp.c_fc
  rawset(fc, "forward", function(m, ...) calls = calls + 1; return getmetatable(m).__index.forward(m, ...) end)
  close(mlp(x, r), want, 1e-6, "MLP(x, res) with c_fc's forward wrapped")
  t.eq(calls, 1, "MLP: a wrapped c_fc is called (an FSDP unit of its own keeps its gather)")
  rawset(fc, "forward", nil)
end

-- the kernels it runs: the counting device with CUDA's kernel set
if pcall(meta.mimic, "cuda") and meta.by_name().matmul_epilogue_bf16 and meta.by_name().matmul_epilogue_bf16.present then
  local M, C, H, N = 6, 16, 32, 16
  local v = {}
  local shapes_of = { { M, C }, { H, C }, { H }, { N, H }, { N }, { M, N } }
  for i = 1, 6 do
    local a = { unpack(shapes_of[i]) }
    a[#a + 1] = { seed = i, device = "meta" }
    v[i] = fsdp.randn(unpack(a)):cast("bf16"):requires_grad(true)
  end
  meta.reset()
  local y = fsdp.mlp(v[1], v[2], v[3], v[4], v[5], { residual = v[6] })
  local f = meta.by_name()
  t.ok(f.matmul_epilogue_bf16.calls == 2 and f.matmul_bf16.calls == 0, "CUDA set, mlp: forward is two epilogue GEMMs")
  meta.reset()
  y:backward(fsdp.ones(M, N, { device = "meta" }):cast("bf16"))
  local e = meta.by_name()
  t.ok(e.matmul_epilogue_bf16.calls == 2 and e.matmul_bf16.calls == 2, "CUDA set, mlp: backward is c_proj's dx "
    .. "GEMM with the GELU backward and dW GEMM with its bias gradient, then c_fc's two GEMMs")
  t.eq(e.gelu_backward_bf16.calls + e.bias_gelu_backward_bf16.calls + e.sum_dim_bf16.calls, 0,
    "CUDA set, mlp: no GELU backward or bias-sum pass of its own")
  -- nothing recorded (evaluation, sampling): no GELU input kept, so none written (GELU_BIAS)
  local function written(fn)
    meta.reset()
    fn()
    local c = meta.by_name().matmul_epilogue_bf16
    return c.calls, c.bytes_written
  end
  local mlp = function() return fsdp.mlp(v[1], v[2], v[3], v[4], v[5], { residual = v[6] }) end
  local lin = function() return fsdp.linear(v[1], v[2], v[3], { gelu = true }) end
  local calls, bytes = written(mlp)
  t.ok(calls == 2 and bytes == 2 * (2 * M * H + M * N), "CUDA set, mlp recorded: writes aux, h and y (" .. bytes .. ")")
  calls, bytes = written(function() fsdp.no_grad(mlp) end)
  t.ok(calls == 2 and bytes == 2 * (M * H + M * N), "CUDA set, mlp under no_grad: h and y only (" .. bytes .. ")")
  calls, bytes = written(lin)
  t.ok(calls == 1 and bytes == 2 * 2 * M * H, "CUDA set, gelu linear recorded: aux and y (" .. bytes .. ")")
  calls, bytes = written(function() fsdp.no_grad(lin) end)
  t.ok(calls == 1 and bytes == 2 * M * H, "CUDA set, gelu linear under no_grad: y only (" .. bytes .. ")")
  local plain_in = {}
  for i = 1, 6 do plain_in[i] = v[i]:detach() end
  calls, bytes = written(function() fsdp.linear(plain_in[1], plain_in[2], plain_in[3], { gelu = true }) end)
  t.ok(calls == 1 and bytes == 2 * M * H, "CUDA set, gelu linear of tensors needing no gradient: y only")
end
meta.mimic("cpu")

-- the same values recorded or not (GELU_AUX_BIAS and GELU_BIAS on the device, or the unfused ops)
do
  local x, w1, b1 = input(51, 5, 24):to(dev):bf16(), input(52, 16, 24):to(dev):bf16(), input(53, 16):to(dev):bf16()
  local w2, b2, r = input(54, 24, 16):to(dev):bf16(), input(55, 24):to(dev):bf16(), input(56, 5, 24):to(dev):bf16()
  local wr = w1:detach():requires_grad(true)
  local want_l = fsdp.linear(x, wr, b1, { gelu = true })
  local want_m = fsdp.mlp(x, wr, b1, w2, b2, { residual = r })
  local got_l = fsdp.no_grad(function() return fsdp.linear(x, wr, b1, { gelu = true }) end)
  local got_m = fsdp.no_grad(function() return fsdp.mlp(x, wr, b1, w2, b2, { residual = r }) end)
  close(got_l, want_l, 0, "gelu linear under no_grad: the recorded values, bit for bit (" .. dev .. ")")
  close(got_m, want_m, 0, "mlp under no_grad: the recorded values, bit for bit (" .. dev .. ")")
  close(got_l, fsdp.bias_gelu(x:matmul(w1, { tb = true }), b1), 1 / 128, "gelu linear under no_grad: the composition")
end

-- ---- a backward that fails part way (an allocation over the memory cap) ----
-- An FSDP unit's flat gradient (bf16 compute) is not zeroed: each slice
-- takes its first gradient as a write, and under no_sync the flat gradient
-- is kept for the next backward. Here W reaches the op through a product
-- (a non-leaf), so the op makes W's gradient itself; when that allocation
-- fails, the bias's slice must stay unwritten, so that the next backward
-- writes it rather than adding to what the memory held. Caps from the
-- forward's memory up, 512 bytes apart, stop the backward at each
-- allocation in turn; the lowest that stops the op's own backward stops it
-- at its first allocation (W's gradient, nothing written yet): a retry and
-- a synced backward then give the gradients of two backwards, bit for bit.
-- (The fused op's path: elsewhere the Linear is a matmul and an add, whose
-- backward writes the bias's gradient before the matmul's allocates.)
if dev ~= "cpu" and os.getenv("FSDP_CUDA_EPILOGUES") ~= "0" then
  local Module = require "fsdp.nn.module"
  local Probe = Module:extend("Probe")
  function Probe:__init(n_in, n_out, gelu)
    self.gelu = gelu
    self:param("weight", { n_out, n_in }, Module.init.normal(0.5))
    self:param("bias", { n_out }, Module.init.normal(0.5))
    if gelu then   -- c_proj back to n_in: its weight's gradient is as large as c_fc's
      self:param("weight2", { n_in, n_out }, Module.init.normal(0.5))
      self:param("bias2", { n_in }, Module.init.normal(0.5))
    end
  end
  function Probe:forward(x)
    if self.gelu then return fsdp.mlp(x, self.weight * 1.0, self.bias, self.weight2 * 1.0, self.bias2) end
    return fsdp.linear(x, self.weight * 1.0, self.bias)
  end
  -- (in 1032, a multiple of 8: the parameters' slices stay 16-byte aligned, as the epilogue wants)
  for _, gelu in ipairs({ false, true }) do
    local op = gelu and "mlp" or "linear"
    local what = op .. " on " .. dev
    local sharded = fsdp.shard(Probe(1032, gelu and 8 or 5, gelu), { seed = 7, mixed_precision = { compute = "bf16" } })
    local x = input(11, 3, 1032):to(dev):bf16()
    local function step() sharded(x):float():sum():backward() end
    local function grads()
      local g = {}
      for _, seg in ipairs(sharded.segments) do g[seg.path] = flat(seg.grad) end
      return g
    end
    sharded:zero_grad()
    local y = sharded(x):float():sum()
    fsdp.memory.reset_peak(dev)
    local before = fsdp.memory.stats(nil, dev).current
    y:backward()
    local span = fsdp.memory.stats(nil, dev).peak - before
    sharded:zero_grad()
    sharded:no_sync(step)
    step()
    local want = grads()
    local in_op, worst, n = 0, 0, 0
    for k = 0, math.ceil(span / 512) + 1 do
      if in_op > 0 then break end
      sharded:zero_grad()
      fsdp.memory.empty_cache(dev)
      local stopped = false
      sharded:no_sync(function()
        y = sharded(x):float():sum()
        fsdp.memory.set_cap(fsdp.memory.stats(nil, dev).current + k * 512, dev)
        local ok, err = pcall(function() y:backward() end)
        fsdp.memory.set_cap(0, dev)
        y = nil
        stopped = not ok and tostring(err):find("backward of " .. op, 1, true) ~= nil
        if stopped then step() end
      end)
      if stopped then
        in_op = in_op + 1
        step()
        for path, g in pairs(grads()) do
          n = n + 1
          for i = 1, #want[path] do   -- (a NaN reads back as nil)
            local d = g[i] and math.abs(g[i] - want[path][i]) or math.huge
            if d ~= d then d = math.huge end
            worst = math.max(worst, d)
          end
        end
      end
    end
    t.ok(in_op == 1, string.format("%s: a cap stopped the op's own backward (of %d bytes' span)", what, span))
    t.ok(n > 0 and worst == 0, string.format("%s: a retry after the op's backward failed: the gradients of the " ..
      "backwards that ran (worst difference %g over %d gradients)", what, worst, n))
  end
end

-- bad input: a clear error naming the op and the tensors
local x, w, b = fsdp.zeros(3, 4), fsdp.zeros(5, 4), fsdp.zeros(5)
t.raises(function() return fsdp.linear(x, fsdp.zeros(5, 3), b) end, { "fsdp_linear", "weight", "[5,3]", "in = 4" },
  "linear: weight of the wrong width")
t.raises(function() return fsdp.linear(x, fsdp.zeros(20), b) end, { "fsdp_linear", "(out, in)" }, "linear: 1-D weight")
t.raises(function() return fsdp.linear(x, w, fsdp.zeros(4)) end, { "fsdp_linear", "bias", "[4]", "5 elements" },
  "linear: a bias of the wrong length")
t.raises(function() return fsdp.linear(fsdp.zeros(4), w, b) end, { "fsdp_linear", "at least 2 dims" },
  "linear: a 1-D x")
t.raises(function() return fsdp.linear(x, w:bf16(), b) end, { "fsdp_linear", "dtypes differ" },
  "linear: dtypes differ")
t.raises(function() return fsdp.linear(fsdp.zeros(3, 4, { dtype = "i64" }), w, b) end,
  { "fsdp_linear", "f32 or bf16" }, "linear: an integer x")
t.raises(function() return fsdp.linear(x, w, b, { residual = fsdp.zeros(5) }) end,
  { "fsdp_linear", "res", "[5]", "not broadcast" }, "linear: a residual that would broadcast")
t.raises(function() return fsdp.linear(x, w, b, { residual = fsdp.zeros(3, 4) }) end,
  { "fsdp_linear", "res", "[3,4]" }, "linear: a residual of another shape")
t.raises(function() return fsdp.linear(x, nil, b) end, { "linear weight" }, "linear: no weight")
local w1, w2 = fsdp.zeros(6, 4), fsdp.zeros(2, 6)
t.raises(function() return fsdp.mlp(x, fsdp.zeros(6, 3), nil, w2, nil) end, { "fsdp_mlp", "w_fc", "[6,3]", "in = 4" },
  "mlp: w_fc of the wrong width")
t.raises(function() return fsdp.mlp(x, w1, fsdp.zeros(5), w2, nil) end, { "fsdp_mlp", "b_fc", "[5]", "6 elements" },
  "mlp: b_fc of the wrong length")
t.raises(function() return fsdp.mlp(x, w1, nil, fsdp.zeros(2, 5), nil) end,
  { "fsdp_mlp", "w_proj", "[2,5]", "hidden = 6" }, "mlp: w_proj of the wrong width")
t.raises(function() return fsdp.mlp(x, w1, nil, w2, fsdp.zeros(3)) end, { "fsdp_mlp", "b_proj", "[3]", "2 elements" },
  "mlp: b_proj of the wrong length")
t.raises(function() return fsdp.mlp(x, w1, nil, w2, nil, { residual = fsdp.zeros(3, 4) }) end,
  { "fsdp_mlp", "res", "[3,4]", "not broadcast" }, "mlp: a residual of another shape")
t.raises(function() return fsdp.mlp(x, w1:bf16(), nil, w2, nil) end, { "fsdp_mlp", "dtypes differ" },
  "mlp: dtypes differ")
t.raises(function() return fsdp.mlp(fsdp.zeros(4), w1, nil, w2, nil) end, { "fsdp_mlp", "at least 2 dims" },
  "mlp: a 1-D x")
-- options: a misspelt key is an error naming the op and the key, never a silently dropped residual
t.raises(function() return fsdp.linear(x, w, b, { residul = fsdp.zeros(3, 5) }) end,
  { "fsdp.linear", "unknown option 'residul'", "did you mean 'residual'" }, "linear: a misspelt option")
t.raises(function() return fsdp.linear(x, w, b, { gleu = true }) end,
  { "fsdp.linear", "unknown option 'gleu'", "did you mean 'gelu'" }, "linear: a misspelt gelu")
t.raises(function() return fsdp.linear(x, w, b, "gelu") end, { "fsdp.linear", "options must be a table" },
  "linear: options not a table")
t.raises(function() return fsdp.mlp(x, w1, nil, w2, nil, { residul = fsdp.zeros(3, 2) }) end,
  { "fsdp.mlp", "unknown option 'residul'", "did you mean 'residual'" }, "mlp: a misspelt option")
t.raises(function() return fsdp.mlp(x, w1, nil, w2, nil, { gelu = true }) end,
  { "fsdp.mlp", "unknown option 'gelu'" }, "mlp: gelu is not an mlp option (it always has one)")
if dev ~= "cpu" then
  t.raises(function() return fsdp.linear(x:cpu(), w, b) end, { "fsdp_linear", "different devices" },
    "linear: tensors on two devices")
end

t.done()
