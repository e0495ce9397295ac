-- Strict inputs at the call that receives them: shapes whose dims multiply
-- past int64 (zero-element ones included), a second backward through a
-- graph the first one freed, bad seeds, arange sizes no table can hold, and
-- optimizer options of the wrong type. Each must raise a clear error at
-- once, and leave the library working.

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local optim = require "fsdp.optim"

-- ---- sizes: zero elements but dims that multiply past 2^60 ----
local huge = 2 ^ 62
t.raises(function() fsdp.zeros(0, huge, huge) end, { "too large", "[0,4611686018427387904,4611686018427387904]" },
  "zeros(0, 2^62, 2^62) refused")
t.raises(function() fsdp.zeros(huge, 0, 8) end, "too large", "zeros(2^62, 0, 8) refused")
local e = fsdp.zeros(0, 3)
t.eq(e:numel(), 0, "a zero-element tensor of sensible dims still works")
t.raises(function() e:view(0, huge, huge) end, "too large", "reshape of a zero-element tensor to huge dims refused")
t.raises(function() e:expand(huge, huge, 0, 3) end, "too large", "expand of a zero-element tensor to huge dims refused")
local z = fsdp.zeros(0, 3) + fsdp.zeros(0, 3)
t.eq(z:numel(), 0, "elementwise on zero elements gives zero elements")

-- ---- a second backward through a freed graph ----
local w = fsdp.randn(3, { seed = 1 }):requires_grad(true)
local loss = (w * w):sum()
loss:backward()
local g1 = w:get_grad():tolist()
t.all_near(g1, { 2 * w:tolist()[1], 2 * w:tolist()[2], 2 * w:tolist()[3] }, 1e-6, "first backward: 2w")
t.raises(function() loss:backward() end, { "fsdp_backward", "freed by an earlier backward", "run the forward again" },
  "second backward on the same loss refused")
t.all_near(w:get_grad():tolist(), g1, 0, "the refused backward left the gradient as it was")
local loss2 = (w * w):sum()
loss2:backward()
t.all_near(w:get_grad():tolist(), { 2 * g1[1], 2 * g1[2], 2 * g1[3] }, 1e-6, "a fresh forward backpropagates again")

-- ---- seeds ----
t.raises(function() fsdp.manual_seed("x") end, { "fsdp.manual_seed", "whole number", "x (string)" },
  "manual_seed('x') refused")
t.raises(function() fsdp.manual_seed(-1) end, "whole number", "manual_seed(-1) refused")
t.raises(function() fsdp.manual_seed(1.5) end, "whole number", "manual_seed(1.5) refused")
fsdp.manual_seed(7)
local a = fsdp.randn(4):tolist()
fsdp.manual_seed(7)
t.all_near(fsdp.randn(4):tolist(), a, 0, "randn works and repeats after the refused seeds")

-- ---- arange ----
local t0 = os.clock()
t.raises(function() fsdp.arange(0, 1e12) end, { "fsdp.arange", "1000000000000 elements", "at most" },
  "arange(0, 1e12) refused up front")
t.ok(os.clock() - t0 < 1, "arange(0, 1e12) refused without building anything")
t.raises(function() fsdp.arange(0, "x") end, { "stop must be a finite number", "x (string)" }, "arange(0, 'x') refused")
t.raises(function() fsdp.arange(0, 1 / 0) end, "stop must be a finite number", "arange(0, inf) refused")
t.all_near(fsdp.arange(1, 2, 0.25):tolist(), { 1, 1.25, 1.5, 1.75 }, 0, "arange(1, 2, 0.25)")
t.eq(fsdp.arange(5, 1):numel(), 0, "arange(5, 1) is empty")

-- ---- AdamW options checked at construction ----
local p = fsdp.zeros(2):requires_grad(true)
t.raises(function() optim.AdamW({ p }, { lr = "x" }) end, { "AdamW", "lr must be a finite number", "x (string)" },
  "AdamW{lr='x'} refused at construction")
t.raises(function() optim.AdamW({ p }, { betas = { 0.9, "y" } }) end, "betas[2] must be a finite number",
  "AdamW betas with a string refused")
t.raises(function() optim.AdamW({ { params = { p }, lr = -1 } }) end, { "group 1", "lr must be" },
  "a group's negative lr refused")
local ok = pcall(optim.AdamW, { p }, { lr = 1e-3 })
t.ok(ok, "AdamW with good options builds")

t.done()
