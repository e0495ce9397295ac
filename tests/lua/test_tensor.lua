-- Tensor API: constructors, operators against plain Lua, views, printing,
-- dtypes, memory statistics, :free().
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

-- ---- binding ----
t.ok(type(fsdp.version()) == "string" and #fsdp.version() > 0, "version")
t.eq(fsdp.rank(), 0, "rank")
t.eq(fsdp.world(), 1, "world")
fsdp.set_num_threads(2)
t.eq(fsdp.num_threads(), 2, "num_threads")
fsdp.set_num_threads(1)

-- ---- constructors ----
local z = fsdp.zeros(2, 3)
t.all_near(z:shape(), { 2, 3 }, 0, "zeros shape")
t.all_near(z:tolist(), { { 0, 0, 0 }, { 0, 0, 0 } }, 0, "zeros values")
t.eq(z:dtype(), "f32", "default dtype")
t.eq(z:device(), fsdp.default_device(), "on the default device")
t.eq(z:dim(), 2, "dim")
t.eq(z:numel(), 6, "numel")
t.eq(z:size(2), 3, "size(2)")
t.eq(z:size(-1), 3, "size(-1)")
t.eq(#z, 2, "__len")
t.all_near(fsdp.zeros({ 4 }, { dtype = "i32" }):tolist(), { 0, 0, 0, 0 }, 0, "zeros table shape, i32")
t.eq(fsdp.zeros({ 4 }, { dtype = fsdp.i64 }):dtype(), "i64", "dtype constant")
t.all_near(fsdp.ones(3):tolist(), { 1, 1, 1 }, 0, "ones")
t.all_near(fsdp.full({ 2, 2 }, 7.5):tolist(), { { 7.5, 7.5 }, { 7.5, 7.5 } }, 0, "full")
t.all_near(fsdp.empty(5, 2):shape(), { 5, 2 }, 0, "empty shape")
t.all_near(fsdp.arange(4):tolist(), { 0, 1, 2, 3 }, 0, "arange(n)")
t.all_near(fsdp.arange(1, 2, 0.25):tolist(), { 1, 1.25, 1.5, 1.75 }, 0, "arange(a, b, step)")
t.all_near(fsdp.arange(3, { dtype = "i64" }):tolist(), { 0, 1, 2 }, 0, "arange i64")
local nested = fsdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } })
t.all_near(nested:shape(), { 2, 3 }, 0, "nested table shape")
t.all_near(nested:tolist(), { { 1, 2, 3 }, { 4, 5, 6 } }, 0, "nested table values")
t.all_near(fsdp.tensor({ 1, 2, 3, 4, 5, 6 }, { 3, 2 }):tolist(), { { 1, 2 }, { 3, 4 }, { 5, 6 } }, 0,
           "flat table + shape")
t.eq(fsdp.tensor(2.5):dim(), 0, "scalar tensor is 0-D")
t.eq(fsdp.tensor(2.5):item(), 2.5, "scalar item")
t.eq(fsdp.tensor({ 1, 2 }, { requires_grad = true }):requires_grad(), true, "requires_grad option")
t.eq(fsdp.tensor({ 1, 2 }):requires_grad(), false, "no grad by default")
t.raises(function() fsdp.tensor({ { 1, 2 }, { 3 } }) end, "ragged", "ragged nested table")
t.raises(function() fsdp.zeros(2, { dtype = "f64" }) end, "unknown dtype", "unknown dtype name")

-- random init is reproducible from (seed, stream)
local r1 = fsdp.randn(1000, { seed = 7 })
local r2 = fsdp.randn(1000, { seed = 7 })
local r3 = fsdp.randn(1000, { seed = 8 })
t.all_near(r1:tolist(), r2:tolist(), 0, "randn same seed, same values")
t.ok(r1:tolist()[1] ~= r3:tolist()[1], "randn other seed, other values")
local big = fsdp.randn(20000, { seed = 1, mean = 2, std = 3 })
local mean = big:mean():item()
local var = ((big - mean) * (big - mean)):mean():item()
t.near(mean, 2, 0.05, "randn mean")
t.near(math.sqrt(var), 3, 0.05, "randn std")
local u = fsdp.rand(5000, { seed = 3, low = -1, high = 2 })
local lo, hi = math.huge, -math.huge
for _, v in ipairs(u:tolist()) do lo, hi = math.min(lo, v), math.max(hi, v) end
t.ok(lo >= -1 and hi < 2 and lo < -0.9 and hi > 1.9, "rand in [low, high)")
t.ok(fsdp.randn(4):tolist()[1] ~= fsdp.randn(4):tolist()[1], "unseeded randn calls differ")

-- ---- operators against plain Lua ----
local A = { { 1, -2, 3 }, { 4, 5, -6 } }
local B = { { 0.5, 2, -1 }, { 3, -4, 8 } }
local a, b = fsdp.tensor(A), fsdp.tensor(B)
local function map2(x, y, f)
  local r = {}
  for i = 1, #x do
    r[i] = {}
    for j = 1, #x[i] do r[i][j] = f(x[i][j], type(y) == "table" and y[i][j] or y) end
  end
  return r
end
t.all_near((a + b):tolist(), map2(A, B, function(x, y) return x + y end), 1e-6, "tensor + tensor")
t.all_near((a - b):tolist(), map2(A, B, function(x, y) return x - y end), 1e-6, "tensor - tensor")
t.all_near((a * b):tolist(), map2(A, B, function(x, y) return x * y end), 1e-6, "tensor * tensor")
t.all_near((a / b):tolist(), map2(A, B, function(x, y) return x / y end), 1e-6, "tensor / tensor")
t.all_near((a + 2):tolist(), map2(A, 2, function(x, y) return x + y end), 1e-6, "tensor + number")
t.all_near((2 + a):tolist(), map2(A, 2, function(x, y) return y + x end), 1e-6, "number + tensor")
t.all_near((a - 2):tolist(), map2(A, 2, function(x, y) return x - y end), 1e-6, "tensor - number")
t.all_near((2 - a):tolist(), map2(A, 2, function(x, y) return y - x end), 1e-6, "number - tensor")
t.all_near((a * 3):tolist(), map2(A, 3, function(x, y) return x * y end), 1e-6, "tensor * number")
t.all_near((3 * a):tolist(), map2(A, 3, function(x, y) return y * x end), 1e-6, "number * tensor")
t.all_near((a / 4):tolist(), map2(A, 4, function(x, y) return x / y end), 1e-6, "tensor / number")
t.all_near((4 / a):tolist(), map2(A, 4, function(x, y) return y / x end), 1e-6, "number / tensor")
t.all_near((-a):tolist(), map2(A, 0, function(x) return -x end), 1e-6, "unary minus")
t.all_near(a:add(b):tolist(), (a + b):tolist(), 0, "t:add")
t.all_near(fsdp.mul(a, 2):tolist(), (a * 2):tolist(), 0, "fsdp.mul")
local row = fsdp.tensor({ 10, 20, 30 })
t.all_near((a + row):tolist(), { { 11, 18, 33 }, { 14, 25, 24 } }, 1e-6, "broadcast (2,3) + (3)")

-- reductions
t.eq(a:sum():item(), 5, "sum all")
t.all_near(a:sum(1):tolist(), { 5, 3, -3 }, 1e-6, "sum dim 1")
t.all_near(a:sum(2):tolist(), { 2, 3 }, 1e-6, "sum dim 2")
t.all_near(a:sum(-1, true):tolist(), { { 2 }, { 3 } }, 1e-6, "sum dim -1 keepdim")
t.all_near(a:mean({ 1, 2 }):tolist(), 5 / 6, 1e-6, "mean dims {1,2}")
t.near(a:mean():item(), 5 / 6, 1e-6, "mean all")

-- matmul
local M1 = { { 1, 2 }, { 3, 4 }, { 5, 6 } }          -- 3x2
local M2 = { { 1, 0, -1, 2 }, { 2, 1, 0, -3 } }      -- 2x4
local function mm(x, y)
  local r = {}
  for i = 1, #x do
    r[i] = {}
    for j = 1, #y[1] do
      local s = 0
      for k = 1, #y do s = s + x[i][k] * y[k][j] end
      r[i][j] = s
    end
  end
  return r
end
local m1, m2 = fsdp.tensor(M1), fsdp.tensor(M2)
t.all_near(m1:matmul(m2):tolist(), mm(M1, M2), 1e-5, "matmul")
t.all_near(m1:transpose(1, 2):matmul(m1, { tb = false, ta = false }):tolist(),
           mm({ { 1, 3, 5 }, { 2, 4, 6 } }, M1), 1e-5, "matmul of a transposed view")
t.all_near(m1:matmul(m1, { tb = true }):tolist(), mm(M1, { { 1, 3, 5 }, { 2, 4, 6 } }), 1e-5, "matmul tb")
t.all_near(m1:matmul(m1, { ta = true }):tolist(), mm({ { 1, 3, 5 }, { 2, 4, 6 } }, M1), 1e-5, "matmul ta")
t.all_near(fsdp.matmul(m1, m2):tolist(), mm(M1, M2), 1e-5, "fsdp.matmul")

-- activations and norms
local X = { { -1.5, 0, 0.5, 2 }, { 1, -3, 0.25, 4 } }
local x = fsdp.tensor(X)
local function map(f) return map2(X, 0, function(v) return f(v) end) end
local function gelu(v) return 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ^ 3))) end
t.all_near(x:gelu():tolist(), map(gelu), 1e-5, "gelu")
t.all_near(x:silu():tolist(), map(function(v) return v / (1 + math.exp(-v)) end), 1e-5, "silu")
local function rows(f)
  local r = {}
  for i = 1, #X do r[i] = f(X[i]) end
  return r
end
local function softmax(v)
  local m, s, r = -math.huge, 0, {}
  for _, e in ipairs(v) do m = math.max(m, e) end
  for _, e in ipairs(v) do s = s + math.exp(e - m) end
  for i, e in ipairs(v) do r[i] = math.exp(e - m) / s end
  return r
end
t.all_near(x:softmax():tolist(), rows(softmax), 1e-5, "softmax")
t.all_near(x:log_softmax():tolist(), rows(function(v)
  local s = softmax(v)
  for i = 1, #s do s[i] = math.log(s[i]) end
  return s
end), 1e-5, "log_softmax")
local W, Bv = { 1, 2, 0.5, -1 }, { 0, 1, -1, 0.5 }
local function layernorm(v)
  local m, var, r = 0, 0, {}
  for _, e in ipairs(v) do m = m + e / #v end
  for _, e in ipairs(v) do var = var + (e - m) ^ 2 / #v end
  for i, e in ipairs(v) do r[i] = (e - m) / math.sqrt(var + 1e-5) * W[i] + Bv[i] end
  return r
end
t.all_near(x:layernorm(fsdp.tensor(W), fsdp.tensor(Bv), 1e-5):tolist(), rows(layernorm), 1e-4, "layernorm")
local function rmsnorm(v)
  local ms, r = 0, {}
  for _, e in ipairs(v) do ms = ms + e * e / #v end
  for i, e in ipairs(v) do r[i] = e / math.sqrt(ms + 1e-6) * W[i] end
  return r
end
t.all_near(x:rmsnorm(fsdp.tensor(W), 1e-6):tolist(), rows(rmsnorm), 1e-4, "rmsnorm")

-- embedding, cross-entropy
local tbl = fsdp.tensor({ { 1, 2 }, { 3, 4 }, { 5, 6 } })
local ids = fsdp.tensor({ 2, 0, 2 }, { dtype = "i64" })
t.all_near(fsdp.embedding(tbl, ids):tolist(), { { 5, 6 }, { 1, 2 }, { 5, 6 } }, 0, "embedding")
local targets = fsdp.tensor({ 3, 0 }, { dtype = "i32" })
local lsm = x:log_softmax():tolist()
t.near(fsdp.cross_entropy(x, targets):item(), -(lsm[1][4] + lsm[2][1]) / 2, 1e-5, "cross_entropy")
local ign = fsdp.tensor({ 3, -100 }, { dtype = "i64" })
t.near(fsdp.cross_entropy(x, ign):item(), -lsm[1][4], 1e-5, "cross_entropy ignore_index")

-- attention: one head, 3 steps, D = 2, causal
local Q = { { 1, 0 }, { 0, 1 }, { 1, 1 } }
local K = { { 1, 2 }, { 0, 1 }, { -1, 1 } }
local V = { { 1, 0 }, { 0, 2 }, { 3, -1 } }
local want = {}
for i = 1, 3 do
  local sc = {}
  for j = 1, i do sc[j] = (Q[i][1] * K[j][1] + Q[i][2] * K[j][2]) / math.sqrt(2) end
  local p = softmax(sc)
  want[i] = { 0, 0 }
  for j = 1, i do
    for d = 1, 2 do want[i][d] = want[i][d] + p[j] * V[j][d] end
  end
end
local function bhtd(m) return fsdp.tensor({ { m } }) end
t.all_near(fsdp.attention(bhtd(Q), bhtd(K), bhtd(V)):tolist()[1][1], want, 1e-5, "causal attention")

-- dropout: p = 0 is the identity; the mask depends only on (seed, offset)
t.all_near(x:dropout(0, 1):tolist(), X, 0, "dropout p=0")
local ones = fsdp.ones(4000)
local d1, d2 = fsdp.dropout(ones, 0.25, 11, 0):tolist(), fsdp.dropout(ones, 0.25, 11, 0):tolist()
t.all_near(d1, d2, 0, "dropout reproducible")
local zeros = 0
for _, v in ipairs(d1) do
  if v == 0 then zeros = zeros + 1 else t.near(v, 1 / 0.75, 1e-6, "dropout scale") break end
end
zeros = 0
for _, v in ipairs(d1) do if v == 0 then zeros = zeros + 1 end end
t.near(zeros / 4000, 0.25, 0.2, "dropout rate")

-- ---- views share storage ----
local base = fsdp.zeros(3, 4)
base:narrow(1, 2, 1):fill(5)               -- row 2
base:narrow(2, 4, 1):fill(7)               -- column 4
t.all_near(base:tolist(), { { 0, 0, 0, 7 }, { 5, 5, 5, 7 }, { 0, 0, 0, 7 } }, 0, "write through narrow views")
local tr = base:transpose(1, 2)
t.all_near(tr:shape(), { 4, 3 }, 0, "transpose shape")
t.eq(tr:is_contiguous(), false, "transpose is not contiguous")
t.all_near(tr:strides(), { 1, 4 }, 0, "transpose strides")
tr:narrow(1, 1, 1):fill(9)                 -- column 1 of base
t.all_near(base:tolist(), { { 9, 0, 0, 7 }, { 9, 5, 5, 7 }, { 9, 0, 0, 7 } }, 0, "write through a transposed view")
local c = tr:contiguous()
t.eq(c:is_contiguous(), true, "contiguous")
t.all_near(c:tolist(), tr:tolist(), 0, "contiguous keeps values")
c:fill(0)
t.eq(base:at(1, 1), 9, "contiguous copy does not alias")
local rs = base:reshape(2, 6)
t.all_near(rs:tolist(), { { 9, 0, 0, 7, 9, 5 }, { 5, 7, 9, 0, 0, 7 } }, 0, "reshape")
rs:narrow(2, 2, 1):fill(-1)
t.eq(base:at(1, 2), -1, "reshape of a contiguous tensor is a view")
t.all_near(base:view({ 12 }):shape(), { 12 }, 0, "view with a table")
t.all_near(base:reshape(-1, 2):shape(), { 6, 2 }, 0, "reshape with -1")
local p3 = fsdp.arange(24):reshape(2, 3, 4)
local pp = p3:permute(3, 1, 2)
t.all_near(pp:shape(), { 4, 2, 3 }, 0, "permute shape")
t.eq(pp:at(2, 2, 3), p3:at(2, 3, 2), "permute values")
local ex = fsdp.tensor({ 1, 2, 3 }):reshape(1, 3):expand(2, 3)
t.all_near(ex:tolist(), { { 1, 2, 3 }, { 1, 2, 3 } }, 0, "expand")
t.eq(ex:strides()[1], 0, "expand has stride 0")
local sel = p3:select(1, 2)
t.all_near(sel:shape(), { 3, 4 }, 0, "select shape")
t.eq(sel:at(1, 1), 12, "select values")
t.eq(p3:select(3, -1):at(1, 1), 3, "select with a negative index")
local cp = fsdp.zeros(2, 3)
cp:copy(fsdp.tensor({ 1, 2, 3 }))
t.all_near(cp:tolist(), { { 1, 2, 3 }, { 1, 2, 3 } }, 0, "copy broadcasts")
cp:copy(4)
t.eq(cp:sum():item(), 24, "copy of a number fills")
local cl = cp:clone()
cl:fill(0)
t.eq(cp:sum():item(), 24, "clone does not alias")
local d = fsdp.tensor({ 1, 2 }, { requires_grad = true })
local dd = d:detach()
t.eq(dd:requires_grad(), false, "detach drops requires_grad")
dd:fill(3)
t.all_near(d:tolist(), { 3, 3 }, 0, "detach shares storage")

-- ---- item / tolist ----
t.eq(fsdp.tensor({ { 42 } }):item(), 42, "item of a 1x1")
t.eq(fsdp.tensor(3):tolist(), 3, "tolist of a 0-D tensor")
t.all_near(fsdp.tensor({ 1, 2 }, { dtype = "i64" }):tolist(), { 1, 2 }, 0, "tolist i64 gives numbers")
t.eq(type(fsdp.tensor({ 1, 2 }, { dtype = "i64" }):tolist()[1]), "number", "tolist i64 type")

-- ---- dtypes ----
local exact = { 1.5, -2, 0.15625, 256, -0.0078125 }
local bf = fsdp.tensor(exact, { dtype = "bf16" })
t.eq(bf:dtype(), "bf16", "bf16 tensor")
t.all_near(bf:tolist(), exact, 0, "bf16 exact values round trip")
t.all_near(bf:float():tolist(), exact, 0, "bf16 -> f32")
local third = fsdp.tensor({ 1 / 3 }):bf16()
t.near(third:tolist()[1], 1 / 3, 4e-3, "bf16 rounds to 8 bits of mantissa")
t.ok(third:tolist()[1] ~= 1 / 3, "bf16 is not f32")
t.all_near((bf * 2):float():tolist(), { 3, -4, 0.3125, 512, -0.015625 }, 0, "bf16 ops")
t.all_near(fsdp.tensor({ 1.7, -2.2 }):cast("i32"):tolist(), { 1, -2 }, 0, "cast to i32")
t.eq(fsdp.tensor({ 7 }, { dtype = "u16" }):cast("f32"):item(), 7, "u16 to f32")

-- ---- printing ----
local s = tostring(fsdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }))
local on = " on " .. fsdp.default_device() .. "]"
t.ok(s:find("[f32 tensor of shape (2, 3)" .. on, 1, true), "footer line: " .. s)
t.ok(s:find("1  2  3", 1, true) and s:find("4  5  6", 1, true), "integers in rows: " .. s)
s = tostring(fsdp.tensor({ 0.5, -1.25 }))
t.ok(s:find("0.5000", 1, true) and s:find("-1.2500", 1, true), "fixed-point floats: " .. s)
s = tostring(fsdp.tensor({ 1e-7, 3e6 }))
t.ok(s:find("e%-07") and s:find("e%+06"), "scientific when the range is wide: " .. s)
s = tostring(fsdp.arange(24):reshape(2, 3, 4))
t.ok(s:find("(2,.,.) = ", 1, true) and s:find("23", 1, true), "3-D slices: " .. s)
s = tostring(fsdp.arange(100000):reshape(100, 1000))
t.ok(s:find("...", 1, true) and s:find("99999", 1, true) and s:find("(100, 1000)", 1, true)
     and #s < 2000, "large tensors abbreviated")
s = tostring(fsdp.tensor({ 1, 2 }, { dtype = "bf16" }))
t.ok(s:find("[bf16 tensor of shape (2)" .. on, 1, true), "bf16 footer")
s = tostring(fsdp.tensor(2.5))
t.ok(s:find("2.5000", 1, true) and s:find("shape ()", 1, true), "scalar printing: " .. s)
t.ok(tostring(fsdp.tensor({ 0 / 0, 1 / 0 })):find("nan", 1, true), "nan printing")

-- ---- memory statistics ----
collectgarbage()
collectgarbage()
local before = fsdp.memory.stats()
local nbytes = 1000000 * 4
local m = fsdp.zeros(1000000, { tag = "param" })
local during = fsdp.memory.stats()
t.ok(during.current >= before.current + nbytes, "current grows by the allocation")
t.ok(during.peak >= during.current, "peak >= current")
t.ok(fsdp.memory.stats("param").current >= nbytes, "tagged param")
t.eq(m:tag(), "param", "tensor tag")
m:free()
local after = fsdp.memory.stats()
t.ok(after.current <= during.current - nbytes, "current drops after :free()")
fsdp.memory.reset_peak()
t.ok(fsdp.memory.stats().peak <= during.current, "reset_peak")
-- the freed block stays cached (reserved) until empty_cache gives it back
local cached = fsdp.memory.stats()
t.ok(cached.reserved >= cached.current + nbytes, "the freed block stays reserved in the cache")
fsdp.memory.empty_cache()
local emptied = fsdp.memory.stats()
t.eq(emptied.reserved, emptied.current, "empty_cache: reserved comes down to current")
t.ok(cached.reserved - emptied.reserved >= nbytes, "empty_cache gives the freed block back")
t.ok(fsdp.memory.all().grad ~= nil, "memory.all")

-- ---- :free() ----
local f = fsdp.ones(3)
f:free()
t.eq(tostring(f), "[freed tensor]", "tostring of a freed tensor")
t.raises(function() return f:sum() end, "freed", "method on a freed tensor")
t.raises(function() return f + 1 end, "freed", "operator on a freed tensor")
t.raises(function() return fsdp.ones(3) + f end, "freed", "freed tensor as an argument")
t.no_error(function() f:free() end, "double free is harmless")
t.ok(not fsdp.is_tensor(f) and fsdp.is_tensor(fsdp.ones(1)), "is_tensor")

-- ---- randint ----
do
  local r = fsdp.randint(-3, 4, 7, 11, { seed = 5 })
  t.eq(r:dtype(), "i64", "randint gives i64")
  t.all_near(r:shape(), { 7, 11 }, 0, "randint's shape")
  local v, u = r:view(-1):tolist(), fsdp.rand(7, 11, { seed = 5 }):view(-1):tolist()
  local bad, seen = 0, {}
  for i = 1, #v do
    if v[i] ~= math.min(-3 + math.floor(u[i] * 7), 3) then bad = bad + 1 end
    seen[v[i]] = true
  end
  t.eq(bad, 0, "randint = floor(low + (high - low) rand) from the same stream, as fsdp.rand gives it")
  local kinds = 0
  for k = -3, 3 do kinds = kinds + (seen[k] and 1 or 0) end
  t.eq(kinds, 7, "77 draws in [-3, 4) hit all 7 values, and no other")
  t.all_near(fsdp.randint(0, 1000, 5, { seed = 9 }):tolist(), fsdp.randint(0, 1000, 5, { seed = 9 }):tolist(), 0,
    "same seed, same values")
  t.raises(function() return fsdp.randint(2, 2, 3) end, { "fsdp.randint", "low < high", "2 and 2" }, "randint: empty range")
  t.raises(function() return fsdp.randint(0, 2 ^ 30, 3) end, { "at most 2^24" }, "randint: too wide a range")
  t.raises(function() return fsdp.randint(0, 5, 3, { dtype = "f32" }) end, { "i64" }, "randint: not i64")
end

t.done()
