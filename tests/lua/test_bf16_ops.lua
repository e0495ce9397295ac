-- bf16 ops end to end, forward and backward, on the default device (CUDA
-- with bf16-native kernels under fsdp-lua-emu or on a GPU; the CPU, which
-- stages bf16 through f32, elsewhere) against the same ops in f32 on the CPU
-- on the same (bf16-rounded) values. Every output and gradient is rounded
-- to bf16 at least once, some several times (a backward's input is a
-- rounded output): within 2^-6 of the largest reference value.
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

local dev = fsdp.default_device()

local close, input, run = t.close_scaled, t.bf16_valued, t.forward_backward

local function check(name, fn, ins, tol)
  -- the weight of the loss, of the output's shape
  local w = input(99, unpack(fn(unpack(ins)):shape()))
  local y_ref, g_ref = run(fn, ins, w, "cpu", "f32")
  local y, g = run(fn, ins, w, dev, "bf16")
  t.eq(y:dtype(), "bf16", name .. ": output stays bf16 on " .. dev)
  close(y, y_ref, tol, name .. " out (" .. dev .. ")")
  for i = 1, #ins do close(g[i], g_ref[i], tol, string.format("%s grad %d (%s)", name, i, dev)) end
end

local tol = 1 / 64
local x, xb = input(1, 4, 5, 24), input(2, 24)
check("add, bias broadcast", function(a, b) return a + b end, { x, xb }, tol)
check("sub, same shape", function(a, b) return a - b end, { x, input(3, 4, 5, 24) }, tol)
check("mul, broadcast rows", function(a, b) return a * b end, { x, input(4, 5, 1) }, tol)
check("div", function(a, b) return a / b end, { x, fsdp.rand(4, 5, 24, { seed = 5, device = "cpu" }):bf16():float() + 1 }, tol)
check("scale and add_scalar", function(a) return (a * 0.5 + 2) * 3 end, { x }, tol)
check("gelu", function(a) return a:gelu() end, { x }, tol)
check("silu", function(a) return a:silu() end, { x }, tol)
check("softmax", function(a) return a:softmax() end, { x }, tol)
check("log_softmax", function(a) return a:log_softmax() end, { x }, tol)
check("layernorm", function(a, w, b) return fsdp.layernorm(a, w, b) end, { x, input(6, 24), input(7, 24) }, tol)
check("rmsnorm", function(a, w) return fsdp.rmsnorm(a, w) end, { x, input(8, 24) }, tol)
-- a tensor used twice: its gradient accumulates (bf16 + bf16)
check("gradient accumulation", function(a) return a * a + a:gelu() end, { x }, tol)

-- cross-entropy on bf16 logits: loss (f32 math) and dlogits
do
  local logits = input(9, 12, 37)
  local targets = fsdp.tensor({ 0, 5, 32, 2, -100, 7, 1, 30, 3, 3, -100, 11 }, { dtype = "i64", device = "cpu" })
  local function ce(device, dtype)
    local l = logits:to(device):cast(dtype):detach():requires_grad(true)
    local loss = fsdp.cross_entropy(l, targets:to(device), { ignore_index = -100, valid_vocab = 33 })
    loss:backward()
    return loss, l:get_grad()
  end
  local lr, gr = ce("cpu", "f32")
  local l, g = ce(dev, "bf16")
  t.ok(math.abs(l:float():item() - lr:item()) <= 1e-2 * math.abs(lr:item()),
    string.format("cross_entropy loss (%s): %.6g vs %.6g", dev, l:float():item(), lr:item()))
  close(g, gr, tol, "cross_entropy dlogits (" .. dev .. ")")
end

t.done()
