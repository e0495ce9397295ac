-- fsdp.options: checks a recipe's options against a schema, so a typo or
-- a value of the wrong type is a one-line error naming the option, the
-- value and what was expected, and --help lists them all.
--
--   local o = options.parse(..., {
--     { "steps", "int", 20, "training steps" },
--     { "preset", { "tiny", "small" }, "tiny", "model size" },
--   }, "gpt2.lua")
local M = {}

local function describe_type(ty)
  if type(ty) == "table" then return "one of " .. table.concat(ty, ", ") end
  return ({ int = "an integer", number = "a number", string = "a string", bool = "true or false" })[ty] or ty
end

local function convert(name, ty, v, recipe)
  local function bad()
    error(string.format("%s: --%s expects %s, got '%s'", recipe, name:gsub("_", "-"), describe_type(ty),
      tostring(v)), 0)
  end
  if type(ty) == "table" then
    for _, c in ipairs(ty) do if v == c then return v end end
    bad()
  elseif ty == "int" then
    if type(v) ~= "number" or v ~= math.floor(v) then bad() end
  elseif ty == "number" then
    if type(v) ~= "number" then bad() end
  elseif ty == "bool" then
    if type(v) ~= "boolean" then bad() end
  elseif ty == "string" then
    if type(v) == "number" then v = tostring(v) end
    if type(v) ~= "string" then bad() end
  end
  return v
end

function M.usage(schema, recipe)
  local lines = { "usage: fsdp-lua " .. recipe .. " [--option=value ...]", "", "options:" }
  for _, s in ipairs(schema) do
    local default = s[3] == nil and "none" or tostring(s[3])
    lines[#lines + 1] = string.format("  --%-16s %s (%s; default %s)", s[1]:gsub("_", "-"), s[4] or "",
      describe_type(s[2]), default)
  end
  return table.concat(lines, "\n")
end

--- Options with defaults filled in; raises on unknown names and bad values.
-- --help prints the usage and exits.
function M.parse(given, schema, recipe)
  given = given or {}
  recipe = recipe or "recipe"
  if given.help then
    print(M.usage(schema, recipe))
    os.exit(0)
  end
  local known, out = {}, {}
  for _, s in ipairs(schema) do
    known[s[1]] = s
    out[s[1]] = s[3]
  end
  for k, v in pairs(given) do
    if type(k) == "number" then
      error(string.format("%s: unexpected argument '%s' (options are --name=value)", recipe, tostring(v)), 0)
    end
    local s = known[k]
    if not s then
      local names = {}
      for _, e in ipairs(schema) do names[#names + 1] = e[1]:gsub("_", "-") end
      error(string.format("%s: unknown option --%s (known: %s)", recipe, k:gsub("_", "-"),
        table.concat(names, ", ")), 0)
    end
    out[k] = convert(k, s[2], v, recipe)
  end
  return out
end

return M
