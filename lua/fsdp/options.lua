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
-- Every recipe also takes --config=FILE: a Lua file returning a table of
-- option values, { steps = 200, lr = 3e-4, strategy = "full_shard" } (names
-- with _ or -), run with no globals at all (no io, os, require); options on
-- the command line override it, and unknown names are refused as on the
-- command line. options.sources(o) says where each value came from,
-- options.describe(o) prints the resolved options as a compact block, and
-- options.plain(o) is a JSON-able copy (for --metrics and checkpoints).
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
  elseif ty == "int" or ty == "number" then
    -- nan and inf pass every min/max comparison, so they are refused here
    if type(v) ~= "number" then bad() end
    if v ~= v or v == math.huge or v == -math.huge then
      M.fail("%s: %s expects a finite number, got '%s'", recipe, flag(name), tostring(v))
    end
    if ty == "int" and v ~= math.floor(v) then bad() end
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

-- The engine's reason without its "op: 'path': " prefix.
local function reason(msg) return (tostring(msg):gsub("^[^:]*: '.*': ", "")) end

--- nil when a file can be written at path, else why not. Tried on a
-- temporary name beside it, as the writers do (created afresh, never through
-- a link, and removed again), one name per rank: ranks sharing a folder
-- probe at once; a FIFO or device at path is refused without opening it.
function M.outfile_problem(path)
  local fio = require "fsdp.io"
  local kind = fio.stat(path)
  if kind == "dir" then return "Is a directory" end
  if kind == "other" then return "not a regular file (a FIFO, device or socket)" end
  local probe = string.format("%s.probe%d.tmp", path, require("fsdp.distributed").rank())
  local ok, f = pcall(fio.open, probe, "w")
  if not ok then return reason(f) end
  f:close()
  os.remove(probe)
  return nil
end

--- nil when path names a readable regular file, else why not (a FIFO,
-- device or folder is refused at once: the check cannot block).
function M.file_problem(path)
  local why = require("fsdp.io").file_problem(path)
  return why and reason(why)
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

-- ---- ranks agree on the options ----

-- Options that may differ between ranks: they change how fast a rank runs,
-- not what the job computes. A schema entry with rank_local = true is one too.
M.RANK_LOCAL = { threads = true }
-- Bytes read from each end of a data file for its identity.
local IDENTITY_BLOCK = 65536

local function show_value(v)
  if type(v) == "number" then return string.format("%.17g", v) end
  return tostring(v)
end

-- A file's identity: its size and a hash of its first and last blocks.
local function file_identity(fio, path)
  local _, size = fio.stat(path)
  local f = io.open(path, "rb")
  if not f then return string.format("%d bytes, unreadable", size) end
  local head = f:read(IDENTITY_BLOCK) or ""
  local tail = ""
  if size > IDENTITY_BLOCK then
    f:seek("set", math.max(size - IDENTITY_BLOCK, IDENTITY_BLOCK))
    tail = f:read(IDENTITY_BLOCK) or ""
  end
  f:close()
  return string.format("%d bytes, content %s", size, fio.hash_string(head .. tail))
end

-- What a data source names on this rank: a file's size and content hash,
-- a folder's or a glob's files with theirs; nil when it names nothing here.
local function source_identity(v)
  if type(v) ~= "string" or v == "" then return nil end
  local fio = require "fsdp.io"
  local ok, id = pcall(function()
    local kind = fio.stat(v)
    if kind == "file" then return file_identity(fio, v) end
    local files = {}
    if kind == "dir" then
      for _, name in ipairs(fio.list_dir(v)) do
        if name:sub(1, 1) ~= "." then files[#files + 1] = v .. "/" .. name end
      end
    elseif v:find("[%*%?%[]") then
      files = require("fsdp.data").glob(v)
    else
      return "absent"
    end
    local parts = {}
    for _, path in ipairs(files) do
      if fio.is_file(path) then parts[#parts + 1] = path .. " " .. file_identity(fio, path) end
    end
    return string.format("%d files, listing %s", #parts, fio.hash_string(table.concat(parts, "\n")))
  end)
  return ok and id or nil
end

-- Every option that changes the training, as text, in schema order: its
-- value, and for a data source or input file what it names on this rank.
local function resolved_entries(out, schema)
  local entries = {}
  for _, s in ipairs(schema) do
    local k = s[1]
    if not M.RANK_LOCAL[k] and not s.rank_local then
      local text = show_value(out[k])
      if s[2] == "file" or k == "data" or k:match("_data$") then
        local id = source_identity(out[k])
        if id then text = text .. " (" .. id .. ")" end
      end
      entries[#entries + 1] = { k, text }
    end
  end
  return entries
end

-- Every rank compares its resolved options with rank 0's; the first option
-- that differs (in schema order), and the lowest rank where it does, make
-- the same usage error on every rank, before anything is built.
local function agree_on_options(out, schema, recipe)
  local dist = require "fsdp.distributed"
  if dist._ranks_running() == 1 or dist._dry_run() then return end
  local mine = resolved_entries(out, schema)
  local texts = {}
  for i, e in ipairs(mine) do texts[i] = e[2] end
  local root = dist.broadcast(texts, 0)
  local first = math.huge
  for i, e in ipairs(mine) do
    if root[i] ~= e[2] then first = i break end
  end
  if #root ~= #mine and first == math.huge then first = math.min(#root, #mine) + 1 end
  first = dist.min(first)
  if first == math.huge then return end
  local me = dist.rank()
  local which = dist.min((root[first] ~= (mine[first] and mine[first][2])) and me or math.huge)
  local theirs = dist.broadcast(mine[first] and mine[first][2] or "(no such option)", which)
  local name = mine[first] and mine[first][1] or "?"
  local locals = {}
  for k in pairs(M.RANK_LOCAL) do locals[#locals + 1] = flag(k) end
  table.sort(locals)
  M.fail("%s: option %s differs between ranks: rank 0 has %s, rank %d has %s (every rank must be started with "
    .. "the same options; only %s may differ)", recipe, flag(name), tostring(root[first]), which, theirs,
    table.concat(locals, ", "))
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

-- ---- --config=FILE ----

-- Where each resolved table's values came from, and its schema order.
local resolved_info = setmetatable({}, { __mode = "k" })

-- The config file's table: run in an empty environment, with an
-- instruction budget (a loop that never ends is an error, not a hang).
local function read_config(path, recipe)
  local where = string.format("%s: --config=%s", recipe, path)
  if type(path) ~= "string" then M.fail("%s: --config expects a file, as --config=run.lua", recipe) end
  local f, err = io.open(path, "rb")
  if not f then M.fail("%s: %s", where, (tostring(err):gsub("^.-: ", ""))) end
  local text = f:read("*a") or ""
  f:close()
  if text:byte(1) == 27 then M.fail("%s: a Lua source file is expected, not bytecode", where) end
  local chunk, perr = loadstring(text, "=" .. path)
  if not chunk then M.fail("%s: %s", where, tostring(perr)) end
  setfenv(chunk, setmetatable({}, { __index = function(_, k)
    error(string.format("'%s' is not available in a config file (it holds option values only)", tostring(k)), 2)
  end }))
  if jit then jit.off(chunk, true) end   -- count hooks reach interpreted code only
  debug.sethook(function() error("the file runs too long (a config holds option values)", 2) end, "", 1e7)
  local ok, t = pcall(chunk)
  debug.sethook()
  if not ok then M.fail("%s: %s", where, tostring(t)) end
  if type(t) ~= "table" then
    M.fail("%s: the file must return a table of option values, as return { steps = 100 } (it returned %s)", where,
      type(t))
  end
  local out = {}
  for k, v in pairs(t) do
    if type(k) ~= "string" then
      M.fail("%s: option names are strings, as { steps = 100 } (got the key %s)", where, tostring(k))
    end
    local vt = type(v)
    if vt ~= "string" and vt ~= "number" and vt ~= "boolean" then
      M.fail("%s: %s is a %s; option values are numbers, strings or booleans", where, k, vt)
    end
    out[(k:gsub("-", "_"))] = v
  end
  return out
end

--- options.sources(o) -> { name = "default" | "config" | "command line" }
-- for a table options.parse returned (nil for another table).
function M.sources(o)
  local info = resolved_info[o]
  return info and info.sources
end

--- options.plain(o) -> the options as a plain table (JSON-able): names to
-- values, without nil ones.
function M.plain(o)
  local out = {}
  for k, v in pairs(o) do
    if type(k) == "string" and (type(v) == "string" or type(v) == "number" or type(v) == "boolean") then out[k] = v end
  end
  return out
end

local function show(v)
  if type(v) == "string" then
    if v == "" or v:find("[%s\"']") then return string.format("%q", v) end
    return v
  end
  if type(v) == "number" and v ~= math.floor(v) then return string.format("%.6g", v) end
  return tostring(v)
end
M.show = show

--- options.describe(o[, width]) -> the resolved options as lines of at most
-- width (100) columns: "name=value ..." in schema order, then which the
-- config file and the command line set.
function M.describe(o, width)
  width = width or 100
  local info = resolved_info[o]
  local names = info and info.names or {}
  if not info then
    for k in pairs(o) do names[#names + 1] = k end
    table.sort(names)
  end
  local lines, line = {}, "options:"
  for _, n in ipairs(names) do
    if o[n] ~= nil then
      local item = n:gsub("_", "-") .. "=" .. show(o[n])
      if #line + 1 + #item > width and line ~= "  " then
        lines[#lines + 1] = line
        line = "  " .. item
      else
        line = line .. (line == "  " and "" or " ") .. item
      end
    end
  end
  lines[#lines + 1] = line
  if info then
    local by = { config = {}, ["command line"] = {} }
    for _, n in ipairs(names) do
      local src = info.sources[n]
      if by[src] then by[src][#by[src] + 1] = n:gsub("_", "-") end
    end
    local set = {}
    if info.config_path then
      set[#set + 1] = string.format("%s sets %s", info.config_path, #by.config > 0 and table.concat(by.config, ", ")
        or "nothing the command line did not")
    end
    if #by["command line"] > 0 then set[#set + 1] = "the command line sets " .. table.concat(by["command line"], ", ") end
    if #set > 0 then
      local text, cur = "(" .. table.concat(set, "; ") .. "; the rest are defaults)", " "
      for word in text:gmatch("%S+") do
        if #cur + 1 + #word > width and cur ~= " " then lines[#lines + 1], cur = cur, " " end
        cur = cur .. " " .. word
      end
      lines[#lines + 1] = cur
    end
  end
  return table.concat(lines, "\n")
end

--- options.differences(now, saved) -> a list of "--name=now (saved: x)"
-- for each option whose value differs between two plain tables, ignoring
-- the names in skip (a set); empty when they agree.
function M.differences(now, saved, skip)
  skip = skip or {}
  local names, seen = {}, {}
  for _, t in ipairs { now, saved } do
    for k in pairs(t) do
      if type(k) == "string" and not seen[k] and not skip[k] then names[#names + 1], seen[k] = k, true end
    end
  end
  table.sort(names)
  local out = {}
  for _, k in ipairs(names) do
    local a, b = now[k], saved[k]
    if a ~= b then
      out[#out + 1] = string.format("%s=%s (the checkpoint's: %s)", flag(k), a == nil and "unset" or show(a),
        b == nil and "unset" or show(b))
    end
  end
  return out
end

--- Options with defaults filled in; raises a usage error on unknown names,
-- bad values, values out of range and unreadable files.
-- --help prints the usage and exits.
function M.parse(given, schema, recipe)
  given = given or {}
  recipe = recipe or "recipe"
  local has_config = false
  for _, s in ipairs(schema) do if s[1] == "config" then has_config = true end end
  if not has_config then   -- every recipe takes --config=FILE
    local copy = {}
    for i, s in ipairs(schema) do copy[i] = s end
    copy[#copy + 1] = { "config", "file", nil, "a Lua file returning a table of option values (the command line "
      .. "overrides them)" }
    schema = copy
  end
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
  local sources = {}
  for _, n in ipairs(names) do sources[n] = "default" end
  for k in pairs(given) do if type(k) == "string" then sources[k] = "command line" end end
  local from_config = {}
  if given.config ~= nil and given.config ~= false then
    -- every rank reads the file; when one cannot, all fail with the lowest such rank's message
    local ok, cfg = pcall(read_config, given.config, recipe)
    if not ok and not M.is_usage_error(cfg) then error(cfg, 0) end
    agree_on_files(not ok and cfg.message or nil, recipe)
    local cfg_names = {}
    for k in pairs(cfg) do cfg_names[#cfg_names + 1] = k end
    table.sort(cfg_names)
    for _, k in ipairs(cfg_names) do
      if k == "config" or k == "help" then
        M.fail("%s: --config=%s: %s cannot be set in a config file", recipe, given.config, flag(k))
      end
      if not known[k] then
        local near = M.closest(k, names)
        M.fail("%s: --config=%s: unknown option '%s' (%s)", recipe, given.config, k,
          near and ("did you mean '" .. near .. "'?") or "see --help")
      end
    end
    local merged = {}
    for k, v in pairs(given) do merged[k] = v end
    for _, k in ipairs(cfg_names) do
      if merged[k] == nil then merged[k], sources[k], from_config[k] = cfg[k], "config", true end
    end
    given = merged
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
      local who = from_config[k] and string.format("%s: --config=%s", recipe, given.config) or recipe
      v = convert(k, s[2], v, who)
      if type(v) == "number" and s.min and v < s.min then
        M.fail("%s: %s must be at least %s, got %s", who, flag(k), tostring(s.min), tostring(v))
      end
      if type(v) == "number" and s.max and v > s.max then
        M.fail("%s: %s must be at most %s, got %s", who, flag(k), tostring(s.max), tostring(v))
      end
      out[k] = v
    end
    if (s[2] == "file" or s[2] == "outfile") and out[k] ~= nil and not problem then
      local why = (s[2] == "file" and M.file_problem or M.outfile_problem)(out[k])
      if why then problem = string.format("%s: %s=%s: %s", recipe, flag(k), out[k], why) end
    end
  end
  agree_on_files(problem, recipe)
  agree_on_options(out, schema, recipe)
  resolved_info[out] = { sources = sources, names = names, config_path = from_config and given.config or nil }
  return out
end

return M
