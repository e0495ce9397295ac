-- Autograd: gradients of small expressions against hand-computed values,
-- accumulation, no_grad, detach, and ops defined in Lua (fsdp.Function),
-- including the recompute pattern of activation checkpointing.
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

local function leaf(v) return fsdp.tensor(v, { requires_grad = true }) end

-- ---- hand-computed gradients ----
local x = leaf({ 1, -2, 3 })
t.eq(x.grad, nil, ".grad is nil before backward")
;(x * x):sum():backward()
t.all_near(x.grad:tolist(), { 2, -4, 6 }, 1e-6, "d sum(x*x) = 2x")
t.all_near(x:grad():tolist(), x.grad:tolist(), 0, "x:grad() is x.grad")
-- a tensor is not callable: w(x) is a mistake (for w:matmul(x)), not w
t.raises(function() return x(fsdp.ones(2)) end, "a tensor is not callable", "w(x) is an error")
t.raises(function() return x() end, "a tensor is not callable", "w() is an error")
t.raises(function() return x.grad(fsdp.ones(1)) end, "a tensor is not callable", "a gradient called with another tensor")
t.all_near(x:get_grad():tolist(), x.grad:tolist(), 0, "x:get_grad()")

local a, b = leaf({ 1, 2, 4 }), leaf({ 3, -1, 0.5 })
;(a * b + a):sum():backward()
t.all_near(a.grad:tolist(), { 4, 0, 1.5 }, 1e-6, "d(a*b + a)/da = b + 1")
t.all_near(b.grad:tolist(), { 1, 2, 4 }, 1e-6, "d(a*b + a)/db = a")

a, b = leaf({ 1, 2, 4 }), leaf({ 2, -1, 0.5 })
;((a - b) / b):sum():backward()
t.all_near(a.grad:tolist(), { 0.5, -1, 2 }, 1e-6, "d((a-b)/b)/da = 1/b")
t.all_near(b.grad:tolist(), { -0.25, -2, -16 }, 1e-5, "d((a-b)/b)/db = -a/b^2")

a = leaf({ 1, 2, 4 })
;((3 - a) * 2 + 1 - a / 4 + 10 / a):sum():backward()
t.all_near(a.grad:tolist(), { -2 - 0.25 - 10, -2 - 0.25 - 2.5, -2 - 0.25 - 10 / 16 }, 1e-5,
           "scalar arithmetic on both sides")

a = leaf({ 1, 2, 3, 4 })
;(-a):mean():backward()
t.all_near(a.grad:tolist(), { -0.25, -0.25, -0.25, -0.25 }, 1e-6, "d mean(-a)")

-- matmul: L = sum(A @ B): dA[i][k] = sum_j B[k][j], dB[k][j] = sum_i A[i][k]
local A = leaf({ { 1, 2 }, { 3, 4 }, { 5, 6 } })
local B = leaf({ { 1, -1, 2 }, { 0, 3, 1 } })
A:matmul(B):sum():backward()
t.all_near(A.grad:tolist(), { { 2, 4 }, { 2, 4 }, { 2, 4 } }, 1e-5, "matmul dA")
t.all_near(B.grad:tolist(), { { 9, 9, 9 }, { 12, 12, 12 } }, 1e-5, "matmul dB")

-- broadcasting: a bias added to every row gets the column sums
local W = leaf({ { 1, 2, 3 }, { 4, 5, 6 } })
local bias = leaf({ 1, 1, 1 })
;((W + bias) * W):sum():backward()
t.all_near(bias.grad:tolist(), { 5, 7, 9 }, 1e-6, "broadcast bias gradient")
t.all_near(W.grad:tolist(), { { 3, 5, 7 }, { 9, 11, 13 } }, 1e-6, "d (W+b)*W / dW = 2W + b")

-- views route gradients to the right elements
local V = leaf({ { 1, 2, 3 }, { 4, 5, 6 } })
;(V:narrow(2, 2, 2) * 2):sum():backward()
t.all_near(V.grad:tolist(), { { 0, 2, 2 }, { 0, 2, 2 } }, 1e-6, "narrow gradient")
V:zero_grad()
t.eq(V.grad, nil, "zero_grad clears")
local coeff = fsdp.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } })
;(V:transpose(1, 2) * coeff):sum():backward()
t.all_near(V.grad:tolist(), { { 1, 3, 5 }, { 2, 4, 6 } }, 1e-6, "transpose gradient")
V:zero_grad()
;(V:reshape(3, 2) * coeff):sum():backward()
t.all_near(V.grad:tolist(), { { 1, 2, 3 }, { 4, 5, 6 } }, 1e-6, "reshape gradient")

-- cross-entropy: d/dlogits = (softmax - onehot) / N
local L = leaf({ { 1, 2, 0.5 }, { -1, 0, 3 } })
local targets = fsdp.tensor({ 2, 0 }, { dtype = "i64" })
fsdp.cross_entropy(L, targets):backward()
local sm = L:softmax():tolist()
t.all_near(L.grad:tolist(), {
  { sm[1][1] / 2, sm[1][2] / 2, (sm[1][3] - 1) / 2 },
  { (sm[2][1] - 1) / 2, sm[2][2] / 2, sm[2][3] / 2 },
}, 1e-5, "cross_entropy gradient")

-- numerical gradients for the nonlinear ops (f32: loose tolerance)
local function gradcheck(name, make, f)
  local v = make()
  local p = leaf(v)
  f(p):backward()
  local got = p.grad:tolist()
  local h = 1e-2
  local num = {}
  for i = 1, #v do
    local up, down = {}, {}
    for j = 1, #v do up[j], down[j] = v[j], v[j] end
    up[i], down[i] = v[i] + h, v[i] - h
    num[i] = (f(fsdp.tensor(up)):item() - f(fsdp.tensor(down)):item()) / (2 * h)
  end
  t.all_near(got, num, 2e-2, "gradcheck " .. name)
end
local function vals() return { -1.5, -0.3, 0.2, 0.9, 2.1, -0.7 } end
local wts = fsdp.tensor({ 0.3, -1.2, 2.0, 0.5, -0.4, 1.1 })
gradcheck("gelu", vals, function(p) return (p:gelu() * wts):sum() end)
gradcheck("silu", vals, function(p) return (p:silu() * wts):sum() end)
gradcheck("softmax", vals, function(p) return (p:softmax() * wts):sum() end)
gradcheck("log_softmax", vals, function(p) return (p:log_softmax() * wts):sum() end)
gradcheck("layernorm", vals, function(p) return (p:reshape(2, 3):layernorm(nil, nil, 1e-5):reshape(6) * wts):sum() end)
gradcheck("rmsnorm", vals, function(p) return (p:reshape(3, 2):rmsnorm(nil, 1e-6):reshape(6) * wts):sum() end)

-- ---- accumulation ----
local acc = leaf({ 1, 2 })
;(acc * 3):sum():backward()
;(acc * 3):sum():backward()
t.all_near(acc.grad:tolist(), { 6, 6 }, 1e-6, "gradients accumulate over two backward calls")
acc.grad = nil
t.eq(acc.grad, nil, "t.grad = nil clears")
;(acc * acc):sum():backward()
t.all_near(acc.grad:tolist(), { 2, 4 }, 1e-6, "fresh gradient after clearing")
acc.grad = fsdp.tensor({ 10, 10 })
t.all_near(acc.grad:tolist(), { 10, 10 }, 0, "t.grad = g sets")

-- backward with an explicit gradient
local e = leaf({ 1, 2, 3 })
;(e * 2):backward(fsdp.tensor({ 1, 0, -1 }))
t.all_near(e.grad:tolist(), { 2, 0, -2 }, 1e-6, "backward(grad)")

-- ---- grad mode ----
local g = leaf({ 1, 2 })
local size0 = fsdp.tape_size()
local inside = fsdp.no_grad(function(v) return v * v end, g)
t.eq(inside:requires_grad(), false, "no_grad: outputs do not require grad")
t.eq(fsdp.tape_size(), size0, "no_grad: nothing recorded")
t.eq(fsdp.is_grad_enabled(), true, "no_grad restores the mode")
local ok = pcall(fsdp.no_grad, function() error("inside") end)
t.ok(not ok and fsdp.is_grad_enabled(), "no_grad restores the mode after an error")
local r1, r2 = fsdp.no_grad(function() return 1, 2 end)
t.ok(r1 == 1 and r2 == 2, "no_grad returns every result")
t.eq(fsdp.set_grad_enabled(false), true, "set_grad_enabled returns the previous mode")
t.eq((g * g):requires_grad(), false, "disabled: not recorded")
t.eq(fsdp.set_grad_enabled(true), false, "set_grad_enabled back on")

-- detach stops the flow
local dx = leaf({ 2, 3 })
;(dx * dx:detach()):sum():backward()
t.all_near(dx.grad:tolist(), { 2, 3 }, 1e-6, "detach: the detached factor is a constant")

-- ---- ops defined in Lua ----
local Square = fsdp.Function {
  forward = function(ctx, v)
    ctx.v = v
    return v * v
  end,
  backward = function(ctx, gout)
    return ctx.v * 2 * gout
  end,
}
local s1 = leaf({ 0.5, -1, 2 })
local s2 = leaf({ 0.5, -1, 2 })
;(Square(s1 * 2 + 1) * 3):sum():backward()       -- engine ops before and after
;(((s2 * 2 + 1) * (s2 * 2 + 1)) * 3):sum():backward()
t.all_near(s1.grad:tolist(), s2.grad:tolist(), 1e-5, "Lua square op matches engine ops")
t.all_near(s1.grad:tolist(), { 24, -12, 60 }, 1e-5, "Lua square op: hand-computed: 12 (2s + 1)")
t.eq(fsdp.autograd.live_ops(), 0, "Lua op ids freed after backward")

-- several inputs, a non-tensor argument, one input without grad
local Axpy = fsdp.Function {
  forward = function(ctx, alpha, u, w)
    ctx.alpha = alpha
    return u * alpha + w
  end,
  backward = function(ctx, gout)
    return nil, gout * ctx.alpha, gout
  end,
}
local u, wconst = leaf({ 1, 2 }), fsdp.tensor({ 5, 5 })
local out = Axpy(3, u, wconst)
t.all_near(out:tolist(), { 8, 11 }, 1e-6, "Function forward value")
t.eq(out:requires_grad(), true, "Function output requires grad")
;(out * out):sum():backward()
t.all_near(u.grad:tolist(), { 48, 66 }, 1e-5, "Function with several arguments")

-- two outputs, only one used: the other's gradient is materialized as zeros
local Split
Split = fsdp.Function {
  forward = function(ctx, v) return v * 2, v * 3 end,
  backward = function(ctx, g1, g2)
    ctx.saw_zero = g2:sum():item() == 0
    Split.last_ctx = ctx
    return g1 * 2 + g2 * 3
  end,
}
local sp = leaf({ 1, 1 })
local o1 = Split(sp)
o1:sum():backward()
t.all_near(sp.grad:tolist(), { 2, 2 }, 1e-6, "two-output Function")
t.ok(Split.last_ctx and Split.last_ctx.saw_zero, "unused output gets a zero gradient")

-- an input returned as is: the leaf stays a leaf
local Identity = fsdp.Function {
  forward = function(ctx, v) return v end,
  backward = function(ctx, gout) return gout * 5 end,
}
local idl = leaf({ 1, 2 })
Identity(idl):sum():backward()
t.all_near(idl.grad:tolist(), { 5, 5 }, 1e-6, "Function returning its input")

-- not recorded without grad
local nrec = leaf({ 1 })
local before = fsdp.tape_size()
local plain = fsdp.no_grad(function() return Square(nrec) end)
t.eq(plain:requires_grad(), false, "Function under no_grad is not recorded")
t.eq(fsdp.tape_size(), before, "Function under no_grad: tape unchanged")
t.eq(fsdp.autograd.live_ops(), 0, "no id taken under no_grad")

-- recorded but never differentiated: freed when the tape is cleared
local pending = Square(leaf({ 2 }))
t.eq(fsdp.autograd.live_ops(), 1, "a recorded Lua op holds an id")
fsdp.tape_clear()
t.eq(fsdp.autograd.live_ops(), 0, "tape_clear frees the ids")
pending = nil

-- ---- recompute (the activation-checkpointing pattern) ----
-- forward runs without recording; backward pushes a tape, re-runs forward
-- with grad on detached inputs, runs an inner backward and pops.
local Recompute = fsdp.Function {
  forward = function(ctx, fn, v)
    ctx.fn, ctx.v = fn, v
    return fn(v)
  end,
  backward = function(ctx, gout)
    fsdp.tape_push()
    local vd = ctx.v:detach():requires_grad(true)
    local y = fsdp.enable_grad(ctx.fn, vd)
    y:backward(gout)
    fsdp.tape_pop()
    return nil, vd.grad
  end,
}
local Wp = leaf({ { 0.5, -1, 2 }, { 1, 0.25, -0.5 } })
local block = function(v) return Square(v:matmul(Wp)):gelu() end   -- nests a Lua op too
local xin = fsdp.tensor({ { 1, 2 }, { -1, 0.5 }, { 0.3, -2 } })

local x1 = leaf(xin:tolist())
local h1 = Recompute(block, x1 * 2)
;(h1 * h1):sum():backward()
local gx_ckpt, gw_ckpt = x1.grad:tolist(), Wp.grad:tolist()
Wp:zero_grad()
local x2 = leaf(xin:tolist())
local h2 = block(x2 * 2)
;(h2 * h2):sum():backward()
t.all_near(h1:tolist(), h2:tolist(), 1e-6, "recompute: same forward")
t.all_near(gx_ckpt, x2.grad:tolist(), 1e-4, "recompute: same input gradient")
t.all_near(gw_ckpt, Wp.grad:tolist(), 1e-4, "recompute: same parameter gradient")
t.eq(fsdp.autograd.live_ops(), 0, "recompute: every id freed")
t.eq(fsdp.tape_size(), 0, "recompute: tape empty")

-- many steps keep the registry bounded
for _ = 1, 200 do
  local q = leaf({ 1, 2 })
  Square(Square(q)):sum():backward()
end
t.eq(fsdp.autograd.live_ops(), 0, "registry bounded over many steps")

t.done()
