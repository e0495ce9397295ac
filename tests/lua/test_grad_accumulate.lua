-- Gradient accumulation into a bf16 tensor where the device has no bf16
-- axpy (the CPU): staged through f32 a chunk at a time, each element
-- widened, added and rounded once, as a whole-tensor staging does; and
-- never holding f32 copies of the whole gradient (an embedding's
-- gradient, say, would otherwise cost three copies of itself at once).
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

local MiB = 2 ^ 20
-- 4.2M elements: four whole staging chunks of 2^20 and a ragged one
local R, C = 4099, 1031
local device = "cpu"
local x = fsdp.randn({ R, C }, { seed = 1, device = device }):bf16():detach():requires_grad(true)
local w1 = fsdp.randn({ R, C }, { seed = 2, device = device }):bf16()
local w2 = fsdp.randn({ R, C }, { seed = 3, device = device }):bf16()

-- the reference: per element bf16(f32(w1) + f32(w2)), then + f32(w2) again
local want1 = (w1:float() + w2:float()):bf16()
local want2 = (want1:float() + w2:float()):bf16()

local function same(a, b)
  local e = a:float() - b:float()
  local d = (e * e):sum():item()
  return d == 0, d
end

collectgarbage()
fsdp.memory.reset_peak(device)
local base = fsdp.memory.stats(nil, device).current
;((x * w1):sum() + (x * w2):sum()):backward()   -- (two contributions in one backward)
local peak1 = fsdp.memory.stats(nil, device).peak - base
local ok, d = same(x.grad, want1)
t.ok(ok, string.format("two contributions accumulate as bf16(f32 + f32) per element (sum of squared differences %g)", d))
t.eq(x.grad:dtype(), "bf16", "the gradient stays bf16")

-- a second backward adds into the existing .grad: a view's backward hands
-- w2 on as it is, so what this backward allocates is the add's staging
local y = x:view(R * C)
local g = w2:view(R * C)
collectgarbage()
fsdp.memory.reset_peak(device)
base = fsdp.memory.stats(nil, device).current
y:backward(g)
local peak2 = fsdp.memory.stats(nil, device).peak - base
ok, d = same(x.grad, want2)
t.ok(ok, string.format("a second backward adds into .grad the same way (sum of squared differences %g)", d))

-- the add stages at most a few 4 MiB chunks at a time (besides the copy of
-- the gradient given to backward, which the tape keeps as the view's)
local grad_bytes = 2 * R * C
local bound = grad_bytes + 16 * MiB
t.ok(peak2 <= bound, string.format("adding a %.1f MiB bf16 gradient peaks %.1f MiB above what was held (bound %.1f MiB; "
  .. "whole-tensor f32 staging: %.1f MiB more)", grad_bytes / MiB, peak2 / MiB, bound / MiB, 5 * grad_bytes / MiB))
print(string.format("bf16 accumulation of %d elements: backward peaks %.1f and %.1f MiB above the held memory", R * C,
  peak1 / MiB, peak2 / MiB))
t.done()
