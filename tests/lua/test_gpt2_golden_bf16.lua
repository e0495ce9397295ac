-- The GPT in bf16 compute against PyTorch's bf16 autocast on the same init
-- weights and batch (tests/fixtures/gpt2_tiny_golden_bf16.safetensors, from
-- tools/dev/gpt2_torch.py --golden-bf16). The two are not the same arithmetic:
-- autocast runs matmuls in bf16 but LayerNorm, softmax and the loss in f32,
-- while the engine keeps every activation in bf16 (statistics in f32). So
-- the bound is a bf16 one: for every tensor ||engine - autocast|| /
-- ||autocast|| <= 2^-5, about 16 bf16 roundings (bf16 keeps 8 significant
-- bits, one rounding is <= 2^-9 relative). Measured: 0.2-1.2%, the same size
-- as autocast's own distance from the float64 reference (0.3-1.0%, printed
-- beside each check from gpt2_tiny_golden.safetensors). The loss, a mean of
-- 30 terms, agrees much closer (measured 2e-4): 2^-9.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local st = require "fsdp.safetensors"

local TOL_LOSS = 2 ^ -9       -- relative, the loss (one scalar)
local TOL = 2 ^ -5            -- relative L2, logits and every gradient

local gold16 = st.load("tests/fixtures/gpt2_tiny_golden_bf16.safetensors")
local gold64 = st.load("tests/fixtures/gpt2_tiny_golden.safetensors")
local model, cfg = t.gpt2_tiny_fixture()
local shapes = {}
for _, p in ipairs(model:named_parameters()) do shapes[p.path] = p.tensor:shape() end
-- one rank: the shards are the whole model, gathered in bf16 for compute
local sharded = fsdp.shard(model, { mixed_precision = { compute = "bf16" } })

local rel_err = t.rel_err

local function close(a, b, f64, name)
  local e = rel_err(a, b)
  return t.ok(e <= TOL, string.format("%s: engine bf16 vs autocast %.3g <= %.3g (autocast vs float64 %.3g)", name, e,
    TOL, rel_err(b, f64)))
end

local idx, targets = gold16.input_ids, gold16.targets
t.eq(rel_err(idx, gold64.input_ids) + rel_err(targets, gold64.targets), 0, "same batch as the float64 fixture")
local logits, loss = sharded(idx, targets)
t.eq(logits:dtype(), "bf16", "activations flow in bf16")
local V = cfg.vocab_size
close(logits:narrow(3, 1, V), gold16.logits, gold64.logits, "logits")
local l, want = loss:float():item(), gold16.loss:item()
t.ok(math.abs(l - want) <= TOL_LOSS * math.abs(want),
  string.format("loss %.6f vs autocast %.6f (float64 %.6f): relative %.3g <= %.3g", l, want, gold64.loss:item(),
    math.abs(l - want) / math.abs(want), TOL_LOSS))
loss:backward()
local grads = {}
for _, seg in ipairs(sharded.segments) do grads[seg.path] = seg.grad:view(unpack(shapes[seg.path])) end
local n = 0
for name, g in pairs(model:to_hf(grads)) do
  local want_g = gold16["grad." .. name]
  if t.ok(want_g ~= nil, "fixture has grad." .. name) then
    close(g, want_g, gold64["grad." .. name], "grad " .. name)
    n = n + 1
  end
end
t.eq(n, 2 + 12 * cfg.n_layer + 2, "every parameter's gradient compared")
t.done()
