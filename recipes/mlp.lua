-- mlp.lua: a small MLP learns to tell two interleaved spirals apart.
--   fsdp-lua recipes/mlp.lua --steps=500 --lr=0.5 --hidden=64 --seed=1 --threads=2
local fsdp = require "fsdp"
local o = require("fsdp.options").parse(..., {      -- --key=value options, checked; --help lists them
  { "steps", "int", 300, "training steps", min = 1 }, { "lr", "number", 0.5, "learning rate", min = 0 },
  { "hidden", "int", 64, "hidden width", min = 1 }, { "seed", "int", 1, "init seed", min = 0 },
  { "every", "int", nil, "log every N steps (default: steps/10)", min = 1 },
  { "threads", "int", nil, "CPU threads", min = 1, max = 256 },
}, "mlp.lua")
local steps, lr, hidden, seed = o.steps, o.lr, o.hidden, o.seed
local every = o.every or math.max(1, math.floor(steps / 10))
if o.threads then fsdp.set_num_threads(o.threads) end

-- Data: n points on each of two spirals; class k is spiral k, turned by pi.
local n, xy, labels = 256, {}, {}
for k = 0, 1 do
  for i = 1, n do
    local r, angle = i / n, 2.5 * math.pi * i / n + k * math.pi
    xy[#xy + 1] = r * math.cos(angle)
    xy[#xy + 1] = r * math.sin(angle)
    labels[#labels + 1] = k
  end
end
local x = fsdp.tensor(xy, { 2 * n, 2 })                       -- (N, 2) f32
local y = fsdp.tensor(labels, { 2 * n }, { dtype = "i64" })    -- (N) class ids

-- Parameters: leaves that require grad, initialized from (seed, stream).
local function param(rows, cols, std, stream)
  return fsdp.randn(rows, cols, { seed = seed, stream = stream, std = std, requires_grad = true, tag = "param" })
end
local params = {
  w1 = param(2, hidden, 3.0, 1), b1 = fsdp.zeros(hidden, { requires_grad = true }),
  w2 = param(hidden, hidden, 1 / math.sqrt(hidden), 2), b2 = fsdp.zeros(hidden, { requires_grad = true }),
  w3 = param(hidden, 2, 1 / math.sqrt(hidden), 3), b3 = fsdp.zeros(2, { requires_grad = true }),
}

local function forward(input)
  local p = params
  local h = (input:matmul(p.w1) + p.b1):silu()                 -- engine ops, recorded on the tape
  h = (h:matmul(p.w2) + p.b2):silu()
  return h:matmul(p.w3) + p.b3                                 -- logits (N, 2)
end

for step = 1, steps do
  local loss = fsdp.cross_entropy(forward(x), y)
  loss:backward()                                              -- fills p.grad for every leaf
  fsdp.no_grad(function()                                      -- plain SGD, written in Lua
    for _, p in pairs(params) do
      p:copy(p - p.grad * lr)
      p:zero_grad()
    end
  end)
  if step == 1 or step % every == 0 or step == steps then
    print(string.format("step %4d  loss %.4f", step, loss:item()))
  end
end

-- Accuracy: argmax of the logits against the labels.
local logits, right = fsdp.no_grad(forward, x):tolist(), 0
for i, l in ipairs(logits) do
  if (l[2] > l[1] and 1 or 0) == labels[i] then right = right + 1 end
end
print(string.format("accuracy %.1f%% on %d points", 100 * right / #labels, #labels))
