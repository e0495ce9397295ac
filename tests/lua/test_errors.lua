-- Error paths: every mistake raises a Lua error naming the op and the
-- shapes/dtypes, reported at the caller's line, and the engine keeps
-- working afterwards (DESIGN.md, decision 2).
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

-- After each error: a fresh op still gives the right value.
local function still_works(name)
  local x = fsdp.tensor({ { 1, 2 }, { 3, 4 } })
  t.eq((x:matmul(x) + 1):sum():item(), 58, "engine works after: " .. name)
end

local function case(name, fn, needles)
  local err = t.raises(fn, needles, name)
  still_works(name)
  return err
end

local a, b = fsdp.ones(2, 3), fsdp.ones(4, 5)

local err = case("matmul with wrong shapes", function()
  local r = a:matmul(b)   -- not a tail call: the error names this line
  return r
end, { "fsdp_matmul", "f32[2,3]", "f32[4,5]", "3 vs 4" })
t.ok(err and err:find("test_errors.lua:", 1, true) and not err:find("tensor.lua", 1, true),
     "error is reported at the caller's line: " .. tostring(err))

case("add of non-broadcastable shapes", function() return a + fsdp.ones(4) end,
     { "fsdp_add", "f32[2,3]", "f32[4]", "broadcast" })
case("dtype mismatch f32 + i32", function() return a + fsdp.ones(2, 3, { dtype = "i32" }) end,
     { "fsdp_add", "f32[2,3]", "i32[2,3]" })
case("dtype mismatch f32 + bf16", function() return a + a:bf16() end,
     { "fsdp_add", "bf16[2,3]", "dtypes differ" })
case("embedding id out of range", function()
  return fsdp.embedding(fsdp.ones(3, 2), fsdp.tensor({ 1, 5 }, { dtype = "i64" }))
end, { "fsdp_embedding", "f32[3,2]", "i64[2]", "5" })
case("cross-entropy target out of range", function()
  return fsdp.cross_entropy(fsdp.ones(2, 3), fsdp.tensor({ 0, 7 }, { dtype = "i64" }))
end, { "fsdp_cross_entropy", "f32[2,3]", "7" })

local expanded = fsdp.ones(1, 3):expand(2, 3)
case("fill into an expanded view", function() return expanded:fill(2) end,
     { "fsdp_fill", "f32[2,3]", "broadcast" })
case("copy into an expanded view", function() return expanded:copy(fsdp.zeros(2, 3)) end,
     { "fsdp_copy", "f32[2,3]", "broadcast" })
t.all_near(expanded:tolist(), { { 1, 1, 1 }, { 1, 1, 1 } }, 0, "expanded view unchanged")

-- Allocation over the cap: the message names the request, the tag and the cap.
collectgarbage()
local cap = 1024 * 1024
fsdp.memory.set_cap(fsdp.memory.stats().current + cap)
t.eq(fsdp.memory.get_cap(), fsdp.memory.stats().current + cap, "get_cap")
local ok_cap, cap_err = pcall(function() return fsdp.zeros(2000000, { tag = "activation" }) end)
t.ok(not ok_cap, "allocation over the cap fails")
cap_err = tostring(cap_err)
t.ok(cap_err:find("7.63 MiB", 1, true) and cap_err:find("activation", 1, true) and cap_err:find("cap", 1, true),
     "cap message names size, tag and cap: " .. cap_err)
local small = fsdp.zeros(1000)      -- under the cap: fine
t.eq(small:numel(), 1000, "small allocation under the cap")
fsdp.memory.set_cap(0)
local big = fsdp.zeros(2000000)
t.eq(big:numel(), 2000000, "allocation after the cap is lifted")
big:free()
still_works("cap")

case("reshape to a wrong numel", function() return a:reshape(4, 2) end, { "fsdp_reshape", "f32[2,3]", "8", "6" })
case("narrow out of range", function() return a:narrow(2, 3, 2) end, { "narrow", "f32[2,3]", "size 3" })
case("narrow of a bad dim", function() return a:narrow(3, 1, 1) end, { "narrow", "f32[2,3]", "dim 3" })
case("transpose of a bad dim", function() return a:transpose(1, 3) end, { "transpose", "f32[2,3]", "dim 3" })
case("sum over a bad dim", function() return a:sum(0) end, { "fsdp_sum", "f32[2,3]", "dim 0" })
case("expand to an incompatible shape", function() return a:expand(3, 3) end, { "fsdp_expand", "f32[2,3]" })
case("item of a non-scalar", function() return a:item() end, { "fsdp_tensor_item", "f32[2,3]" })
case("layernorm weight of the wrong size", function() return a:layernorm(fsdp.ones(4)) end,
     { "fsdp_layernorm", "f32[2,3]", "f32[4]" })
case("attention with mismatched shapes", function()
  return fsdp.attention(fsdp.ones(1, 1, 2, 3), fsdp.ones(1, 1, 2, 4), fsdp.ones(1, 1, 2, 4))
end, { "fsdp_attention", "f32[1,1,2,3]", "f32[1,1,2,4]" })
case("requires_grad on an integer tensor", function() return fsdp.ones(2, { dtype = "i32" }):requires_grad(true) end,
     { "i32[2]", "float" })
case("set_num_threads(0)", function() return fsdp.set_num_threads(0) end, { "fsdp_set_num_threads", "0" })
case("unknown dtype", function() return a:cast("f16") end, { "unknown dtype", "f16" })
case("not a tensor", function() return a:matmul(3) end, { "matmul", "expected a tensor", "number" })

-- backward
local x = fsdp.ones(3, { requires_grad = true })
case("backward on a non-scalar without grad", function() (x * 2):backward() end,
     { "fsdp_backward", "f32[3]", "scalar" })
case("backward with a gradient of the wrong shape", function() (x * 2):backward(fsdp.ones(4)) end,
     { "fsdp_backward", "f32[4]", "f32[3]" })
case("backward from a tensor that does not require grad", function() fsdp.ones(1):backward() end,
     { "fsdp_backward", "does not require grad" })
local y = (x * 3):sum()
y:backward()
t.all_near(x.grad:tolist(), { 3, 3, 3 }, 1e-6, "backward works after the failures")

-- a Lua backward that raises: the tape is abandoned, the error comes through
local Bad = fsdp.Function {
  forward = function(ctx, v) return v * 2 end,
  backward = function(ctx, g) error("bad backward on purpose") end,
}
local z = fsdp.ones(2, { requires_grad = true })
case("error inside a Lua backward", function() Bad(z):sum():backward() end, { "bad backward on purpose" })
t.eq(fsdp.tape_size(), 0, "tape cleared after a failed backward")
local w = fsdp.ones(2, { requires_grad = true })
;(w * w):sum():backward()
t.all_near(w.grad:tolist(), { 2, 2 }, 1e-6, "backward works after a failed Lua backward")

-- freed tensors
local f = fsdp.ones(2)
f:free()
case("calling a freed tensor", function() return f:sum() end, { "sum", "freed" })
case("a freed tensor as an operand", function() return a:matmul(f) end, { "matmul", "freed" })
case("arithmetic on a freed tensor", function() return f * 2 end, { "freed" })

t.done()
