-- The GPT against PyTorch: tools/dev/gpt2_torch.py built the same model from
-- tests/fixtures/gpt2_tiny_init.safetensors and stored its logits, loss,
-- every parameter gradient, and 10 AdamW steps (with clipping) computed in
-- float64. The engine, in f32, must agree to a relative error of 1e-4:
-- ||engine - torch|| / ||torch|| per tensor, plus each loss value.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local optim = require "fsdp.optim"
local st = require "fsdp.safetensors"

local TOL = 1e-4

local gold = st.load("tests/fixtures/gpt2_tiny_golden.safetensors")
local model, cfg = t.gpt2_tiny_fixture()
t.eq(model:num_parameters() - (model.padded_vocab - cfg.vocab_size) * cfg.n_embd, 35584,
  "parameter count matches the torch model (padding rows aside)")

local rel_err = t.rel_err   -- ||engine - torch|| / ||torch||, in Lua doubles

local function close(a, b, name)
  local e = rel_err(a, b)
  return t.ok(e <= TOL, string.format("%s: relative error %.3g <= %g", name, e, TOL))
end

local idx, targets = gold.input_ids, gold.targets
local B, T = idx:shape()[1], idx:shape()[2]

-- forward and backward
local logits, loss = model(idx, targets)
local V = cfg.vocab_size
close(logits:narrow(3, 1, V), gold.logits, "logits")
t.near(loss:item(), gold.loss:item(), TOL, "loss")
loss:backward()
local grads = {}
for _, p in ipairs(model:named_parameters()) do grads[p.path] = p.tensor:get_grad() end
local hf_grads = model:to_hf(grads)
local n = 0
for name, g in pairs(hf_grads) do
  local want = gold["grad." .. name]
  if t.ok(want ~= nil, "fixture has grad." .. name) then
    close(g, want, "grad " .. name)
    n = n + 1
  end
end
t.eq(n, 2 + 12 * cfg.n_layer + 2, "every parameter's gradient compared")
-- padded rows of the tied embedding take no gradient
local pad = model.wte.weight:get_grad():narrow(1, V + 1, model.padded_vocab - V)
t.eq(pad:float():sum():item() == 0 and pad:mean():item() == 0, true, "padded vocabulary rows get zero gradient")

-- 10 AdamW steps on the same batch, clipped at 1.0, decay on 2-D tensors
-- only: the clip as a pass over the gradients (clip_grad_norm), then again
-- from the same initial weights with the clip folded into AdamW's pass
-- (step { grad_scale = clip_coef(norm, 1.0) }); both against PyTorch
local want_losses, want_norms = gold.adamw_losses:tolist(), gold.grad_norms:tolist()
local function train(m, how)
  m:zero_grad()
  local opt = optim.AdamW(optim.decay_groups(m:named_parameters(), 0.1), { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8 })
  for step = 1, 10 do
    local _, l = m(idx, targets)
    t.near(l:item(), want_losses[step], TOL, how .. ": AdamW step " .. step .. " loss")
    l:backward()
    local norm
    if how == "clip pass" then
      norm = optim.clip_grad_norm(m:parameters(), 1.0)
      opt:step()
    else
      norm = optim.grad_norm(m:parameters())
      opt:step { grad_scale = optim.clip_coef(norm, 1.0) }
    end
    t.near(norm, want_norms[step], TOL, how .. ": AdamW step " .. step .. " gradient norm")
    opt:zero_grad()
  end
  local final = m:to_hf()
  for name, p in pairs(final) do
    close(p, gold["final." .. name], how .. ": after 10 steps: " .. name)
  end
  return final
end
local clipped = train(model, "clip pass")
local fused = train(t.gpt2_tiny_fixture(), "clip in AdamW")
local worst = 0
for name, p in pairs(clipped) do
  local a, b = p:contiguous():view(-1):tolist(), fused[name]:contiguous():view(-1):tolist()
  for i = 1, #a do worst = math.max(worst, math.abs(a[i] - b[i])) end
end
t.eq(worst, 0, "the clip in AdamW's pass gives the clip pass's weights, bit for bit")

t.done()
