-- Activation recomputation (what PyTorch calls activation checkpointing;
-- here "checkpoint" means saved training state only): a module marked by
-- nn.recompute keeps no activations
-- from its forward; its backward runs the forward again on a fresh tape
-- (fsdp_tape_push) and back-propagates through that. Parameter gradients
-- land in the parameters' .grad directly; the input's gradient goes back to
-- the outer backward. Dropout masks are replayed by rewinding the counter.
local fsdp = require "fsdp"
local layers = require "fsdp.nn.layers"
local full_collect = require("fsdp.core").full_collect

local M = {}

-- What a sharded model's forward hooks are called in: "forward" (this
-- step's forward of a recomputed module), "replay" (its recomputation in
-- backward) or nil. fsdp.shard reads it to gather each unit twice per step
-- as without recomputation (the replay's gather serves the backward).
M.phase = nil

local unpack = unpack or table.unpack
local function pack(...) return { n = select("#", ...), ... } end

local Recompute = fsdp.Function {
  -- any arguments and results; the tensors among them carry gradients
  forward = function(ctx, module, ...)
    ctx.module, ctx.args, ctx.rng_offset = module, pack(...), layers.dropout_rng.offset
    local outer = M.phase
    M.phase = "forward"
    local res = pack(pcall(module.forward, module, ...))
    M.phase = outer
    if not res[1] then error(res[2], 0) end
    res = pack(unpack(res, 2, res.n))
    -- nothing recorded holds the module's intermediates: free them now,
    -- not whenever Lua's collector would get to them
    full_collect()
    return unpack(res, 1, res.n)
  end,
  backward = function(ctx, ...)
    local grads_out = pack(...)
    local rng = layers.dropout_rng
    local resume = rng.offset
    local args = ctx.args
    fsdp.tape_push()
    local ok, err = pcall(function()
      return fsdp.enable_grad(function()
        local inputs = {}
        for i = 1, args.n do   -- tensors that need gradients, cut from the outer graph
          local a = args[i]
          if fsdp.is_tensor(a) and a:requires_grad() then
            a = a:detach()
            a:requires_grad(true)
          end
          inputs[i] = a
        end
        rng.offset = ctx.rng_offset
        local outer = M.phase
        M.phase = "replay"
        local outs = pack(pcall(ctx.module.forward, ctx.module, unpack(inputs, 1, args.n)))
        M.phase = outer
        if not outs[1] then error(outs[2], 0) end
        outs = pack(unpack(outs, 2, outs.n))
        rng.offset = resume
        -- one backward for all outputs: the sum of each output times its gradient
        local root
        for i = 1, outs.n do
          local y, g = outs[i], grads_out[i]
          if fsdp.is_tensor(y) and g ~= nil and y:requires_grad() then
            local term = (y * g):sum()
            root = root and root + term or term
          end
        end
        if root then root:backward() end
        local gin = {}
        for i = 1, args.n do
          if fsdp.is_tensor(inputs[i]) and inputs[i] ~= args[i] then gin[i] = inputs[i]:get_grad() end
        end
        ctx.grads = gin
      end)
    end)
    fsdp.tape_pop()
    full_collect()   -- the recomputed activations are dead now
    rng.offset = resume
    if not ok then error(err, 0) end
    -- one gradient per forward argument: the module first (none)
    return nil, unpack(ctx.grads, 1, args.n)
  end,
}

--- Runs module(...) with recomputation when gradients are on and a tensor
-- argument takes part in the graph; otherwise a plain call (nothing would
-- be recorded anyway).
function M.run(module, ...)
  if fsdp.is_grad_enabled() then
    for i = 1, select("#", ...) do
      local a = select(i, ...)
      if fsdp.is_tensor(a) and a:requires_grad() then return Recompute(module, ...) end
    end
  end
  return module:forward(...)
end

return M
