-- fsdp.policy: wrap policies, which modules of a model become FSDP units
-- (fsdp.shard's `policy`): function(module, path, unclaimed_params) -> boolean.
local Module = require "fsdp.nn.module"

local policy = {}

--- Units at every module whose type name is in the list.
function policy.by_type(...)
  local names = {}
  for _, n in ipairs({ ... }) do names[n] = true end
  return function(m) return names[m.__name] == true end
end

--- One unit per transformer block, and one for each vocabulary-sized table
-- a model marks _vocab_table (an untied token embedding, an untied LM head):
-- each is as large as several blocks, and left in the root it would be held
-- gathered, with its flat gradient, from the forward to the end of the
-- backward. A tied embedding cannot be a unit (why_not_unit) and stays root.
function policy.per_block()
  return function(m) return m.__name == "Block" or (m._vocab_table == true and policy.why_not_unit(m) == nil) end
end

--- Why module m cannot be a unit, or nil when it can: a module whose
-- parameters are used outside its own forward (GPT's token embedding, tied
-- to the LM head) would be resharded when the other use comes, and one
-- without a forward of its own (a ModuleList) is never called, so nothing
-- would run the hooks that gather it.
function policy.why_not_unit(m)
  if m._used_outside_forward then
    return "its parameters are used outside its own forward (it stays with its parent's unit)"
  end
  if m.forward == Module.forward then
    return "it has no forward of its own (a container such as a ModuleList is never called, so nothing would "
      .. "gather it; select its children instead)"
  end
end

--- Units at modules holding at least min_params parameters that no unit
-- below them has claimed (decided children first); modules that cannot be
-- units are passed over.
function policy.by_size(min_params)
  if type(min_params) ~= "number" or min_params < 1 then
    error("fsdp.policy.by_size: expected a positive parameter count, got " .. tostring(min_params), 2)
  end
  return function(m, _, unclaimed) return unclaimed >= min_params and policy.why_not_unit(m) == nil end
end

--- No unit but the root (one flat buffer for the whole model).
function policy.none() return function() return false end end

return policy
