-- fsdp.shard_print: print(sharded), the wrapped module tree, each module
-- that is an FSDP unit marked with the unit's name, its parameters and this
-- rank's shard, under a line naming the strategy, ranks and dtypes.

local function count_str(n)
  if n >= 1e9 then return string.format("%.2fB", n / 1e9) end
  if n >= 1e6 then return string.format("%.2fM", n / 1e6) end
  if n >= 1e3 then return string.format("%.1fK", n / 1e3) end
  return tostring(n)
end

return function(self)
  local units_at = {}
  for _, u in ipairs(self.units) do
    units_at[u.path] = units_at[u.path] or {}
    table.insert(units_at[u.path], u)
  end
  local lines = { string.format("Sharded %s: %s, %d unit(s), %d rank(s) (shard group of %d), compute %s, reduce %s%s",
    self.model.__name, self.strategy, #self.units, self.group:size(), self.shard_group:size(), self.compute, self.reduce,
    self.offload and ", offloaded" or "") }
  local function show(m, name, path, indent)
    local s = string.rep("  ", indent) .. (name and name .. ": " or "") .. m.__name
    local marks = {}
    for _, u in ipairs(units_at[path] or {}) do
      marks[#marks + 1] = string.format("unit %s: %s parameters, shard %s", u.name, count_str(u.numel),
        count_str(u.shard_numel))
    end
    if #marks > 0 then s = s .. "  <" .. table.concat(marks, "; ") .. ">" end
    lines[#lines + 1] = s
    for _, cn in ipairs(m._child_names) do show(m[cn], cn, path == "" and cn or path .. "." .. cn, indent + 1) end
  end
  show(self.model, nil, "", 1)
  return table.concat(lines, "\n")
end
