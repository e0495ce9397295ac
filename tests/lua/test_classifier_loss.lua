-- The fused classifier (fsdp.classifier_cross_entropy: the LM head's matmul
-- and its loss in one op, dlogits written over the logits in the loss's
-- pass) on the default device (CUDA's kernels under fsdp-lua-emu or on a
-- GPU, the CPU's elsewhere) against fsdp.matmul + fsdp.cross_entropy: the
-- loss and the gradients of x and weight bit for bit in f32 and bf16 for a
-- loss gradient of one (the same kernels and the same roundings), at a
-- prime vocabulary, one row, padded rows, ignored rows, all rows ignored and
-- huge logits; scaled losses, an explicit gradient and a loss times a
-- tensor (dloss != 1) within a stated tolerance; two backwards adding into
-- .grad; finite differences in f32; no dlogits under no_grad; the GPT's
-- head (fused) and the Llama's (plain, logits dropped) with
-- forward{logits = false}; and bad input.
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"

local dev = fsdp.default_device()
local function flat(x) return x:float():cpu():contiguous():view(-1):tolist() end
local function max_diff(a, b)
  local x, y, w = flat(a), flat(b), 0
  if #x ~= #y then return math.huge end
  for i = 1, #x do
    local d = math.abs(x[i] - y[i])
    if d ~= d then d = math.huge end
    w = math.max(w, d)
  end
  return w
end

-- The loss: the same per-row losses and sum; its mean is rounded once more
-- apart where fsdp.cross_entropy takes the mean on the host (a GPU with
-- targets that may hold ignore_index) and this op on the device (no sync):
-- within 2^-22 relative, else equal.
local function same_loss(got, want, name)
  local g = type(got) == "number" and got or got:float():item()
  local w = type(want) == "number" and want or want:float():item()
  return t.ok(math.abs(g - w) <= 2 ^ -22 * math.abs(w), string.format("%s: %.9g vs %.9g", name, g, w))
end

-- targets: ids below valid, every 4th row ignored when asked, all when none
local function targets_for(N, valid, ignore_every, none)
  local list, s = {}, 7
  for n = 1, N do
    s = (s * 48271) % 2147483647
    list[n] = (none or (ignore_every and n % ignore_every == 0)) and -100 or s % valid
  end
  if N > 1 and not none then list[1] = valid - 1 end
  return fsdp.tensor(list, { dtype = "i64", device = dev })
end

-- (loss, dx, dw) of head(x, w, y) with loss:backward(grad) after scale(loss)
local function run(fused, x0, w0, y, valid, dtype, scale, grad)
  local x = x0:to(dev):cast(dtype):detach():requires_grad(true)
  local w = w0:to(dev):cast(dtype):detach():requires_grad(true)
  local l
  if fused then
    l = fsdp.classifier_cross_entropy(x, w, y, { ignore_index = -100, valid_vocab = valid })
  else
    l = fsdp.cross_entropy(x:matmul(w, { tb = true }), y, { ignore_index = -100, valid_vocab = valid })
  end
  if scale then l = scale(l) end
  l:backward(grad)
  return l, x:get_grad(), w:get_grad()
end

local function inputs(N, C, V, seed, big)
  local x = t.bf16_valued(seed, N, C)
  if big then x = (x * 300):bf16():float() end   -- logits of a few 1e4: exp overflows without the max
  return x, t.bf16_valued(seed + 1, V, C)
end

-- ---- a loss gradient of one: the same numbers as matmul + cross_entropy ----
local cases = {
  { N = 5, C = 8, V = 97, valid = 97, what = "V prime" },
  { N = 1, C = 4, V = 13, valid = 13, what = "one row" },
  { N = 9, C = 16, V = 64, valid = 61, ignore = 4, what = "padded rows, ignored rows" },
  { N = 4, C = 3, V = 11, valid = 11, none = true, what = "all rows ignored" },
  { N = 6, C = 8, V = 40, valid = 37, big = true, what = "huge logits" },
  { N = 3, C = 5, V = 7, valid = 7, what = "V below a 16-byte pack" },
}
for k, c in ipairs(cases) do
  local x0, w0 = inputs(c.N, c.C, c.V, 10 * k, c.big)
  local y = targets_for(c.N, c.valid, c.ignore, c.none)
  for _, dtype in ipairs({ "f32", "bf16" }) do
    local tag = string.format("%s (%d x %d, V %d) %s on %s", c.what, c.N, c.C, c.V, dtype, dev)
    local l0, dx0, dw0 = run(false, x0, w0, y, c.valid, dtype)
    local l1, dx1, dw1 = run(true, x0, w0, y, c.valid, dtype)
    t.eq(l1:dtype(), dtype, "loss in the dtype of x: " .. tag)
    same_loss(l1, l0, "loss: " .. tag)
    t.ok(l1:float():item() == l1:float():item(), "loss is a number: " .. tag)
    t.eq(max_diff(dx1, dx0), 0, "dx bit for bit: " .. tag)
    t.eq(max_diff(dw1, dw0), 0, "dweight bit for bit: " .. tag)
    if c.none then t.eq(l1:float():item(), 0, "no rows count: loss 0, " .. tag) end
  end
end

-- ---- dloss != 1 ----
-- The scale goes into the GEMMs' alpha (a known constant) or one pass over
-- dlogits (a device value), where the plain path folds it into dlogits
-- before their rounding: f32 within 1e-6 of the largest gradient, bf16
-- within 2^-7 (a rounding of dlogits to bf16 at another place, 2^-9, and of
-- the product, with room).
do
  local N, C, V, valid = 7, 8, 53, 50
  local x0, w0 = inputs(N, C, V, 90)
  local y = targets_for(N, valid, 3)
  local scales = {
    { name = "loss * 0.25 (known: alpha)", f = function(l) return l * 0.25 end, exact = true },
    { name = "loss * (1/3) (known: alpha)", f = function(l) return l * (1 / 3) end },
    { name = "loss * a tensor (a device value: a pass)",
      f = function(l) return l * fsdp.tensor(0.7, { device = dev }):cast(l:dtype()) end },
    { name = "backward(0.3) (a device value: a pass)", grad = 0.3 },
  }
  for _, s in ipairs(scales) do
    for _, dtype in ipairs({ "f32", "bf16" }) do
      local tag = string.format("%s, %s on %s", s.name, dtype, dev)
      local grad = s.grad and fsdp.tensor(s.grad, { device = dev }):cast(dtype) or nil
      local l0, dx0, dw0 = run(false, x0, w0, y, valid, dtype, s.f, grad)
      local l1, dx1, dw1 = run(true, x0, w0, y, valid, dtype, s.f, grad)
      local tol = dtype == "f32" and 1e-6 or 2 ^ -7
      same_loss(l1, l0, "loss: " .. tag)
      t.close_scaled(dx1, dx0, tol, "dx: " .. tag)
      t.close_scaled(dw1, dw0, tol, "dweight: " .. tag)
      if s.exact then   -- a power of two: scaling commutes with rounding
        t.eq(max_diff(dx1, dx0), 0, "dx bit for bit: " .. tag)
        t.eq(max_diff(dw1, dw0), 0, "dweight bit for bit: " .. tag)
      end
      -- and against the unscaled gradient times the scale, which a lost scale would miss
      local _, dxu = run(true, x0, w0, y, valid, dtype)
      local k = s.grad or (s.name:find("0.25", 1, true) and 0.25) or (s.name:find("1/3", 1, true) and 1 / 3) or 0.7
      t.close_scaled(dx1, dxu:float() * k, dtype == "f32" and 1e-6 or 2 ^ -7, "dx = scale x unscaled dx: " .. tag)
    end
  end
end

-- a Lua backward that writes backward()'s one in place: the tape no longer
-- takes it as known (its storage was written since), so the value the
-- device holds is the one used
do
  local N, C, V = 4, 8, 19
  local x0, w0 = inputs(N, C, V, 60)
  local y = targets_for(N, V)
  local Tripled = fsdp.Function {
    forward = function(_, l) return l * 1 end,
    backward = function(_, g)
      g:fill(3)
      return g
    end,
  }
  for _, dtype in ipairs({ "f32", "bf16" }) do
    local _, dx0, dw0 = run(false, x0, w0, y, V, dtype, function(l) return l * 3 end)
    local _, dx1, dw1 = run(true, x0, w0, y, V, dtype, function(l) return Tripled(l) end)
    local tol = dtype == "f32" and 1e-6 or 2 ^ -7
    t.close_scaled(dx1, dx0, tol, "a gradient written in place by a Lua backward, dx (" .. dtype .. ", " .. dev .. ")")
    t.close_scaled(dw1, dw0, tol, "a gradient written in place by a Lua backward, dweight (" .. dtype .. ", " .. dev
      .. ")")
  end
end

-- ---- two backwards adding into .grad (gradient accumulation) ----
do
  local N, C, V = 6, 8, 29
  local x0, w0 = inputs(N, C, V, 70)
  local ya, yb = targets_for(N, V, 5), targets_for(N, V - 3)
  for _, dtype in ipairs({ "f32", "bf16" }) do
    local function two(fused)
      local x = x0:to(dev):cast(dtype):detach():requires_grad(true)
      local w = w0:to(dev):cast(dtype):detach():requires_grad(true)
      for _, y in ipairs({ ya, yb }) do
        local l = fused and fsdp.classifier_cross_entropy(x, w, y) or fsdp.cross_entropy(x:matmul(w, { tb = true }), y)
        ;(l * 0.5):backward()
      end
      return x:get_grad(), w:get_grad()
    end
    local dx0, dw0 = two(false)
    local dx1, dw1 = two(true)
    t.eq(max_diff(dx1, dx0), 0, "two backwards into .grad, dx bit for bit (" .. dtype .. ", " .. dev .. ")")
    t.eq(max_diff(dw1, dw0), 0, "two backwards into .grad, dweight bit for bit (" .. dtype .. ", " .. dev .. ")")
  end
end

-- ---- finite differences, f32: central, step 1e-2 on O(1) inputs ----
do
  local N, C, V, valid = 4, 3, 11, 10
  local x0, w0 = inputs(N, C, V, 50)
  local y = targets_for(N, valid, 3)
  local _, dx, dw = run(true, x0, w0, y, valid, "f32")
  local function loss(x, w)
    return fsdp.classifier_cross_entropy(x:to(dev), w:to(dev), y, { valid_vocab = valid }):float():item()
  end
  local h, worst = 1e-2, 0
  local xs, ws, gx, gw = x0:tolist(), w0:tolist(), dx:float():cpu():tolist(), dw:float():cpu():tolist()
  local function fd(rows, i, j, as_x)
    local p, m = {}, {}
    for a = 1, #rows do
      p[a], m[a] = {}, {}
      for b = 1, #rows[a] do p[a][b], m[a][b] = rows[a][b], rows[a][b] end
    end
    p[i][j], m[i][j] = rows[i][j] + h, rows[i][j] - h
    local P, M = fsdp.tensor(p), fsdp.tensor(m)
    if as_x then return (loss(P, w0) - loss(M, w0)) / (2 * h) end
    return (loss(x0, P) - loss(x0, M)) / (2 * h)
  end
  for i = 1, N do for j = 1, C do worst = math.max(worst, math.abs(fd(xs, i, j, true) - gx[i][j])) end end
  for i = 1, V do for j = 1, C do worst = math.max(worst, math.abs(fd(ws, i, j, false) - gw[i][j])) end end
  t.ok(worst < 2e-3, string.format("finite differences of x and weight (f32, %s): worst %.3g < 2e-3", dev, worst))
end

-- ---- without gradients: the loss alone, nothing recorded ----
do
  local x0, w0 = inputs(5, 8, 31, 30)
  local y = targets_for(5, 31, 2)
  local x, w = x0:to(dev):requires_grad(true), w0:to(dev):requires_grad(true)
  local before = fsdp.tape_size()
  local l = fsdp.no_grad(function() return fsdp.classifier_cross_entropy(x, w, y) end)
  t.eq(fsdp.tape_size(), before, "no_grad: nothing recorded")
  local want = fsdp.no_grad(function() return fsdp.cross_entropy(x:matmul(w, { tb = true }), y) end)
  same_loss(l, want, "no_grad: the loss of cross_entropy")
end

-- ---- the counting device: one pass forward, nothing of the logits read back, no sync ----
local meta = require "fsdp.meta"
if pcall(meta.mimic, "cuda") then
  local function counts_of(fn)
    meta.reset()
    fn()
    return meta.by_name()
  end
  local N, C, V = 6, 8, 64
  local x = fsdp.randn(N, C, { seed = 1, device = "meta" }):cast("bf16"):requires_grad(true)
  local w = fsdp.randn(V, C, { seed = 2, device = "meta" }):cast("bf16"):requires_grad(true)
  local y = fsdp.tensor({ 1, 2, 3, 4, 5, 60 }, { dtype = "i64", device = "meta" })
  local function syncs(e)
    local s = 0
    for _, v in pairs(e) do s = s + v.syncs end
    return s
  end
  local e = counts_of(function() fsdp.classifier_cross_entropy(x, w, y, { valid_vocab = 61 }):backward() end)
  t.eq(e.cross_entropy_fused_bf16.calls, 1, "meta: the fused kernel once")
  t.eq(e.cross_entropy_fused_bf16.bytes_read, 2 * N * V + 8 * N, "meta: the logits read once")
  t.eq(e.cross_entropy_fused_bf16.bytes_written, 2 * N * V + 4 * N, "meta: dlogits and the losses written")
  t.eq(e.cross_entropy_backward_bf16.calls + e.cross_entropy_rows_bf16.calls, 0, "meta: no other loss kernel")
  t.eq(e.matmul_bf16.calls, 3, "meta: the logits' GEMM and the two of the backward")
  t.eq(e.binary_bf16.calls, 0, "meta: loss:backward() is a known one: no scaling pass")
  t.eq(e.copy_to_host.calls, 0, "meta: host-given targets: nothing read back")
  t.eq(syncs(e), 0, "meta: no host sync")
  e = counts_of(function() (fsdp.classifier_cross_entropy(x, w, y) * 0.125):backward() end)
  t.eq(e.binary_bf16.calls, 0, "meta: a loss scaled by a constant: alpha, no pass")
  e = counts_of(function()
    fsdp.classifier_cross_entropy(x, w, y):backward(fsdp.tensor(2.0, { device = "meta" }):cast("bf16"))
  end)
  t.eq(e.binary_bf16.calls, 1, "meta: a gradient only the device knows: one pass over dlogits")
  t.eq(e.binary_bf16.bytes_written, 2 * N * V, "meta: that pass writes (N, V) bf16")
  e = counts_of(function() fsdp.no_grad(function() fsdp.classifier_cross_entropy(x, w, y) end) end)
  t.eq(e.cross_entropy_fused_bf16.calls, 0, "meta: no_grad writes no dlogits")
  t.eq(e.cross_entropy_rows_bf16.calls, 1, "meta: no_grad runs the loss's rows alone")
  t.eq(syncs(e), 0, "meta: no_grad: no host sync")
  local with_ignored = fsdp.tensor({ 1, -100, 3, 4, 5, 60 }, { dtype = "i64", device = "meta" })
  e = counts_of(function() fsdp.classifier_cross_entropy(x, w, with_ignored):backward() end)
  t.eq(e.copy_to_host.calls, 1, "meta: targets that may hold ignore_index: read once, checked and counted")
  t.eq(syncs(e), 1, "meta: and that read is the only host sync")
  -- memory: dlogits live in the logits' buffer, so the step's activation
  -- peak is one (N, V) bf16 tensor below the plain head's (logits and dlogits)
  local NB, VB = 64, 4096
  local xb = fsdp.randn(NB, C, { seed = 5, device = "meta" }):cast("bf16"):requires_grad(true)
  local wb = fsdp.randn(VB, C, { seed = 6, device = "meta" }):cast("bf16"):requires_grad(true)
  local yb = fsdp.arange(0, NB, { dtype = "i64", device = "meta" })
  local function peak_of(fn)
    fsdp.collect()
    local before = fsdp.memory.stats("activation", "meta").current
    fsdp.memory.reset_peak("meta")
    fn()
    return fsdp.memory.stats("activation", "meta").peak - before
  end
  local plain = peak_of(function()
    local lg = xb:matmul(wb, { tb = true })
    local l = fsdp.cross_entropy(lg, yb)
    lg:free()
    l:backward()
  end)
  local fused = peak_of(function() fsdp.classifier_cross_entropy(xb, wb, yb):backward() end)
  t.ok(plain - fused >= 2 * NB * VB, string.format("meta: activation peak %d B fused, %d B plain: one (N, V) bf16 "
    .. "(%d B) less", fused, plain, 2 * NB * VB))
  meta.mimic("cpu")
end

-- ---- the GPT and Llama heads: forward{logits = false} ----
local function tiny(kind)
  local cfg = { vocab_size = 61, n_layer = 1, n_head = 2, n_embd = 16, block_size = 8 }
  if kind == "llama" then cfg.hidden = 32 end
  return (kind == "llama" and nn.Llama or nn.GPT)(cfg)
end
for _, kind in ipairs({ "gpt", "llama" }) do
  for _, dtype in ipairs({ "f32", "bf16" }) do
    local sharded = fsdp.shard(tiny(kind), { seed = 3, mixed_precision = { compute = dtype } })
    local idx, targets = t.token_batch(4, 2, 7, 61)
    idx, targets = idx:to(dev), targets:to(dev)
    local function grads(opts)
      sharded:zero_grad()
      local logits, loss = sharded(idx, targets, opts)
      loss:backward()
      local g = {}
      for _, seg in ipairs(sharded.segments) do g[seg.path] = flat(seg.grad) end
      return logits, loss:float():item(), g
    end
    local tag = kind .. " " .. dtype .. " on " .. dev
    local lg0, l0, g0 = grads(nil)
    local lg1, l1, g1 = grads({ logits = false })
    t.ok(lg0 ~= nil and lg1 == nil, "forward{logits = false}: no logits, " .. tag)
    same_loss(l1, l0, "forward{logits = false}: the same loss, " .. tag)
    local worst, n = 0, 0
    for path, g in pairs(g0) do
      n = n + 1
      for i = 1, #g do worst = math.max(worst, math.abs(g[i] - g1[path][i])) end
    end
    t.ok(n > 4 and worst == 0, string.format("forward{logits = false}: %d gradients bit for bit (worst %g), %s", n,
      worst, tag))
  end
end

-- ---- bad input ----
do
  local x = fsdp.randn(4, 8, { seed = 1, device = dev })
  local w = fsdp.randn(13, 8, { seed = 2, device = dev })
  local y = fsdp.tensor({ 0, 1, 2, 3 }, { dtype = "i64", device = dev })
  local op = "fsdp_classifier_cross_entropy"
  t.raises(function() fsdp.classifier_cross_entropy(x:view(32), w, y) end, { op, "2-D (N, C)", "f32[32]" },
    "x not 2-D")
  t.raises(function() fsdp.classifier_cross_entropy(x, fsdp.randn(13, 5, { device = dev }), y) end,
    { op, "the same C", "f32[13,5]" }, "C differs")
  t.raises(function() fsdp.classifier_cross_entropy(x, w:bf16(), y) end, { op, "dtypes differ" }, "dtypes differ")
  t.raises(function() fsdp.classifier_cross_entropy(x:cast("i64"), w, y) end, { op, "f32 or bf16" },
    "integer x")
  t.raises(function() fsdp.classifier_cross_entropy(x, w, y:float()) end, { op, "targets must be i32, i64 or u16" },
    "float targets")
  t.raises(function() fsdp.classifier_cross_entropy(x, w, y:narrow(1, 1, 3)) end, { op, "4 elements" },
    "targets of another length")
  t.raises(function() fsdp.classifier_cross_entropy(x, w, y, { valid_vocab = 14 }) end,
    { op, "valid_vocab is 14", "0..13" }, "valid_vocab past V")
  t.raises(function() fsdp.classifier_cross_entropy(x, w, fsdp.tensor({ 0, 1, 13, 3 }, { dtype = "i64", device = dev }))
  end, { op, "targets[2] is 13" }, "a target past V")
  t.raises(function()
    fsdp.classifier_cross_entropy(x, w, fsdp.tensor({ 0, 12, 2, 3 }, { dtype = "i64", device = dev }), { valid_vocab = 12 })
  end, { op, "targets[1] is 12", "< 12 (valid_vocab)" }, "a target in the padded rows")
  t.raises(function() fsdp.classifier_cross_entropy(x, w, y, { ignore = -1 }) end,
    { "fsdp.classifier_cross_entropy", "unknown option 'ignore'" }, "an unknown option")
  t.raises(function() fsdp.classifier_cross_entropy(x, w, y, 5) end, { "options must be a table" }, "options not a table")
  if dev ~= "cpu" then
    t.raises(function() fsdp.classifier_cross_entropy(x:cpu(), w, y) end, { op, "different devices" }, "two devices")
  end
  local m = tiny("gpt")
  local idx, targets = t.token_batch(5, 1, 4, 61)
  t.raises(function() m(idx, nil, { logits = false }) end, { "GPT", "needs targets" }, "logits = false without targets")
  t.raises(function() m(idx, targets, { logits = "no" }) end, { "GPT", "must be a boolean" }, "logits not a boolean")
  t.raises(function() m(idx, targets, { logit = false }) end, { "GPT:forward", "unknown option 'logit'" },
    "an unknown forward option")
  t.raises(function() m(idx, targets, 1) end, { "GPT", "options must be a table" }, "forward options not a table")
end

t.done()
