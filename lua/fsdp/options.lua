-- fsdp.options: checks a recipe's options against a schema, so a typo or
-- a value of the wrong type is a one-line error naming the option, the
-- value and what was expected (and the closest valid name), and --help
-- lists them all.
--
--   local o = options.parse(..., {
--     { "steps", "int", 20, "training steps", min = 1 },
--     { "preset", { "tiny", "small" }, "tiny", "model size" },
--     { "data", "file", "data/corpus.txt", "a readable file" },
--   }, "gpt2.lua")
--   if o.model == "llama" and o.export then options.fail("gpt2.lua: --export needs --model=gpt") end
--
-- These mistakes raise a usage error (options.fail): the command line
-- prints its message as one line, on rank 0 only, and exits with status 2,
-- without a traceback. Every rank raises it, since every rank parses the
-- same arguments.
local M = {}

-- ---- usage errors ----

local UsageError = {}
UsageError.__index = UsageError
UsageError.__tostring = function(e) return e.message end
M.UsageError = UsageError

--- Raises a usage error: string.format(fmt, ...) as its one-line message.
function M.fail(fmt, ...)
  local msg = select("#", ...) > 0 and string.format(fmt, ...) or fmt
  error(setmetatable({ message = msg }, UsageError), 0)
end

--- Ends a run cleanly on every rank: the same one-line message (from rank 0)
-- and exit status `status`, for conditions all ranks agreed on (a
-- non-finite loss, fsdp.guard) rather than mistakes in the options.
function M.stop(status, fmt, ...)
  local msg = select("#", ...) > 0 and string.format(fmt, ...) or fmt
  error(setmetatable({ message = msg, status = status }, UsageError), 0)
end

function M.is_usage_error(e) return getmetatable(e) == UsageError end

-- ---- names ----

-- Edit distance (insertions, deletions, substitutions, swaps of neighbours).
local function distance(a, b)
  local prev2, prev, cur = {}, {}, {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    cur = { [0] = i }
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      local d = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
      if i > 1 and j > 1 and a:byte(i) == b:byte(j - 1) and a:byte(i - 1) == b:byte(j) then
        d = math.min(d, prev2[j - 2] + 1)
      end
      cur[j] = d
    end
    prev2, prev = prev, cur
  end
  return prev[#b]
end
M.distance = distance

--- The candidate closest to name, or nil when none is plausibly meant
-- (more than a third of the letters, and at least 3, would have to change).
function M.closest(name, candidates)
  local best, best_d
  for _, c in ipairs(candidates) do
    local d = distance(name, c)
    if not best_d or d < best_d then best, best_d = c, d end
  end
  if best and best_d <= math.max(2, math.floor(#name / 3)) then return best end
  return nil
end

--- Raises (at `level`, as error() counts) when opts has a key that is not
-- in names: "WHERE: unknown option 'stratgy' (did you mean 'strategy'?)".
function M.check_keys(opts, names, where, level)
  local known = {}
  for _, n in ipairs(names) do known[n] = true end
  for k in pairs(opts) do
    if not known[k] then
      local near = type(k) == "string" and M.closest(k, names)
      error(string.format("%s: unknown option '%s' (%s)", where, tostring(k),
        near and ("did you mean '" .. near .. "'?") or ("known: " .. table.concat(names, ", "))), (level or 1) + 1)
    end
  end
end

local function flag(name) return "--" .. name:gsub("_", "-") end
local launcher_flags   -- below

local function describe_type(ty)
  if type(ty) == "table" then return "one of " .. table.concat(ty, ", ") end
  return ({ int = "an integer", number = "a number", string = "a string", bool = "true or false",
    file = "a readable file", outfile = "a file to write", path_or_flag = "a path, or nothing" })[ty] or ty
end

local function convert(name, ty, v, recipe)
  local function bad()
    M.fail("%s: %s expects %s, got '%s'", recipe, flag(name), describe_type(ty), tostring(v))
  end
  if type(ty) == "table" then
    for _, c in ipairs(ty) do if v == c then return v end end
    local near = type(v) == "string" and M.closest(v, ty)
    if near then
      M.fail("%s: %s expects %s, got '%s' (did you mean '%s'?)", recipe, flag(name), describe_type(ty), tostring(v),
        near)
    end
    bad()
  elseif ty == "int" then
    if type(v) ~= "number" or v ~= math.floor(v) then bad() end
  elseif ty == "number" then
    if type(v) ~= "number" then bad() end
  elseif ty == "bool" then
    if type(v) ~= "boolean" then bad() end
  elseif ty == "path_or_flag" then
    if type(v) == "number" then v = tostring(v) end
    if type(v) ~= "string" and type(v) ~= "boolean" then bad() end
  elseif ty == "string" or ty == "file" or ty == "outfile" then
    if type(v) == "number" then v = tostring(v) end
    if type(v) ~= "string" then bad() end
  end
  return v
end

--- Combinations that cannot work, rejected before anything is built: each
-- rule is { ok, fmt, ... }; the first that does not hold is a usage error
-- "RECIPE: " .. string.format(fmt, ...).
function M.check(recipe, rules)
  for _, r in ipairs(rules) do
    if not r[1] then M.fail("%s: " .. r[2], recipe, unpack(r, 3)) end
  end
end

--- nil when a file can be written at path (trying it, and leaving nothing
-- new behind), else why not.
function M.outfile_problem(path)
  local existed = io.open(path, "rb")
  if existed then
    local ok, rerr = existed:read(0)
    existed:close()
    if ok == nil and rerr then return (tostring(rerr):gsub("^.-: ", "")) end
  end
  local f, err = io.open(path, "ab")
  if not f then return (tostring(err):gsub("^.-: ", "")) end
  f:close()
  if not existed then os.remove(path) end
  return nil
end

--- nil when path names a readable file, else why not.
function M.file_problem(path)
  local f, err = io.open(path, "rb")
  if not f then return (tostring(err):gsub("^.-: ", "")) end
  local ok, rerr = f:read(0)
  f:close()
  if ok == nil and rerr then return (tostring(rerr):gsub("^.-: ", "")) end
  return nil
end

function M.usage(schema, recipe)
  local lines = { "usage: fsdp-lua " .. recipe .. " [--option=value ...]", "", "options:" }
  for _, s in ipairs(schema) do
    local default = s[3] == nil and "none" or tostring(s[3])
    local range = ""
    if s.min and s.max then range = string.format(", %s..%s", s.min, s.max)
    elseif s.min then range = string.format(", >= %s", s.min) end
    lines[#lines + 1] = string.format("  --%-16s %s (%s%s; default %s)", s[1]:gsub("_", "-"), s[4] or "",
      describe_type(s[2]), range, default)
  end
  return table.concat(lines, "\n")
end

-- Files are checked on every rank; when any rank cannot read one, every
-- rank fails with the message of the lowest such rank.
local function agree_on_files(problem, recipe)
  local dist = require "fsdp.distributed"
  local me = dist.rank()
  local first = dist.min(problem and me or math.huge)
  if first == math.huge then return end
  local msg = dist.broadcast(problem, first)
  if first ~= 0 then msg = msg .. string.format(" (on rank %d)", first) end
  M.fail("%s", msg)
end

-- The launcher's own options (--trace, --plan, -i, ...), read from its
-- --help text so that a new one is known here too: given after the recipe
-- they reach the recipe, which says where they belong.
local launcher_set
function launcher_flags()
  if launcher_set then return launcher_set end
  launcher_set = {}
  local ok, cli = pcall(require, "fsdp.cli")
  local text = ok and cli.usage or ""
  local body = text:match("\noptions:\n(.-)\n\n") or ""
  for line in body:gmatch("[^\n]+") do
    local name = line:match("^  (%-%-?[%w][%w%-]*)")
    if name then launcher_set[name] = true end
    for name in line:gmatch(", (%-%-[%w][%w%-]*)") do launcher_set[name] = true end
  end
  launcher_set["--help"], launcher_set["-h"] = nil, nil   -- the recipe's own --help
  return launcher_set
end

--- Options with defaults filled in; raises a usage error on unknown names,
-- bad values, values out of range and unreadable files.
-- --help prints the usage and exits.
function M.parse(given, schema, recipe)
  given = given or {}
  recipe = recipe or "recipe"
  if given.help then
    if require("fsdp.distributed").rank() == 0 then print(M.usage(schema, recipe)) end
    os.exit(0)
  end
  local known, out, names = {}, {}, {}
  for _, s in ipairs(schema) do
    known[s[1]] = s
    out[s[1]] = s[3]
    names[#names + 1] = s[1]
  end
  local keys = {}
  for k in pairs(given) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)   -- the same first error on every rank
  for _, k in ipairs(keys) do
    local v = given[k]
    if type(k) == "number" then
      if launcher_flags()[tostring(v)] then
        M.fail("%s: %s is an fsdp-lua option: put it before the recipe (fsdp-lua %s ... %s)", recipe, tostring(v),
          tostring(v), recipe)
      end
      M.fail("%s: unexpected argument '%s' (options are --name=value)", recipe, tostring(v))
    end
    if not known[k] and launcher_flags()[flag(k)] then
      local as_given = flag(k) .. (v == true and "" or "=" .. tostring(v))
      M.fail("%s: %s is an fsdp-lua option: put it before the recipe (fsdp-lua %s %s ...)", recipe, flag(k), as_given,
        recipe)
    end
    if not known[k] then
      local near = M.closest(k, names)
      local flags = {}
      for i, n in ipairs(names) do flags[i] = n:gsub("_", "-") end
      M.fail("%s: unknown option %s (%sknown: %s)", recipe, flag(k), near and ("did you mean " .. flag(near) .. "? ")
        or "", table.concat(flags, ", "))
    end
  end
  local problem
  for _, s in ipairs(schema) do
    local k, v = s[1], given[s[1]]
    if v ~= nil then
      v = convert(k, s[2], v, recipe)
      if type(v) == "number" and s.min and v < s.min then
        M.fail("%s: %s must be at least %s, got %s", recipe, flag(k), tostring(s.min), tostring(v))
      end
      if type(v) == "number" and s.max and v > s.max then
        M.fail("%s: %s must be at most %s, got %s", recipe, flag(k), tostring(s.max), tostring(v))
      end
      out[k] = v
    end
    if (s[2] == "file" or s[2] == "outfile") and out[k] ~= nil and not problem then
      local why = (s[2] == "file" and M.file_problem or M.outfile_problem)(out[k])
      if why then problem = string.format("%s: %s=%s: %s", recipe, flag(k), out[k], why) end
    end
  end
  agree_on_files(problem, recipe)
  return out
end

return M
