-- Activation checkpointing: a checkpointed module keeps no activations
-- from its forward; its backward runs the forward again on a fresh tape
-- (fsdp_tape_push) and back-propagates through that. Parameter gradients
-- land in the parameters' .grad directly; the input's gradient goes back to
-- the outer backward. Dropout masks are replayed by rewinding the counter.
local fsdp = require "fsdp"
local layers = require "fsdp.nn.layers"

local M = {}

local Recompute = fsdp.Function {
  forward = function(ctx, module, x)
    ctx.module, ctx.x, ctx.rng_offset = module, x, layers.dropout_rng.offset
    local y = module:forward(x)
    -- nothing recorded holds the module's intermediates: free them now,
    -- not whenever Lua's collector would get to them
    collectgarbage()
    return y
  end,
  backward = function(ctx, gy)
    local rng = layers.dropout_rng
    local resume = rng.offset
    fsdp.tape_push()
    local ok, gx = pcall(function()
      return fsdp.enable_grad(function()
        local x = ctx.x:detach()
        x:requires_grad(true)
        rng.offset = ctx.rng_offset
        local y = ctx.module:forward(x)
        rng.offset = resume
        y:backward(gy)
        return x:get_grad()
      end)
    end)
    fsdp.tape_pop()
    collectgarbage()   -- the recomputed activations are dead now
    rng.offset = resume
    if not ok then error(gx, 0) end
    return nil, gx
  end,
}

--- Runs module(x) checkpointed when gradients are on and x takes part in
-- the graph; otherwise a plain call (nothing would be recorded anyway).
function M.run(module, x)
  if fsdp.is_grad_enabled() and fsdp.is_tensor(x) and x:requires_grad() then
    return Recompute(module, x)
  end
  return module:forward(x)
end

return M
