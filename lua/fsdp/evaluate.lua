-- fsdp.evaluate: a model's loss on held-out data, the same on one rank and
-- on many.
--
--   local evaluate = require "fsdp.evaluate"
--   local loss = evaluate.loss(model, val_loader, 4)   -- mean over 4 batches and over ranks
local fsdp = require "fsdp"

local M = {}

--- evaluate.loss(model, loader, n[, on_batch]) -> the mean of n batches' losses,
-- averaged over ranks (each rank's loader gives its rows of a global
-- batch). model(x, y, { logits = false }) returns logits or nil, loss, as
-- the nn language models do: only the loss is needed, so the GPT's head
-- computes it in one fused op that hands out no logits (the same loss as
-- with them); a model that ignores the option returns its logits, which are
-- freed. The model runs in eval mode (no dropout) without gradients, and is
-- back in the mode it was in afterwards. on_batch(i, n) is called after
-- each batch (progress). Collective: every rank calls it.
function M.loss(model, loader, n, on_batch)
  if type(n) ~= "number" or n < 1 or n ~= math.floor(n) then
    error("evaluate.loss: n (batches) must be a positive integer, got " .. tostring(n), 2)
  end
  local was_training = model.training
  model:eval()
  local total = 0
  local ok, err = pcall(fsdp.no_grad, function()
    for i = 1, n do
      local x, y = loader:next()
      local logits, loss = model(x, y, { logits = false })
      total = total + loss:item()
      -- nil, loss from the fused or the chunked head: a nil among them is skipped
      x:free()
      y:free()
      if logits ~= nil then logits:free() end
      loss:free()
      fsdp.collect()   -- the forward's intermediates go back now, not when Lua's collector runs
      if on_batch then on_batch(i, n) end
    end
  end)
  model:train(was_training ~= false)
  if not ok then error(err, 0) end
  return fsdp.distributed.mean(total / n)
end

return M
