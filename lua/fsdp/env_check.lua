-- fsdp.env_check: the FSDP_* environment values checked once, at start-up,
-- before any work: a value that is not valid is an error naming the
-- variable and the value, rather than ignored or read as 0 deep in the run.
-- (docs/environment.md lists every variable; those with a closed set of
-- values or a number are checked here.)
--
--   local problem = require("fsdp.env_check").problem()   -- nil, or one line

local M = {}

local function number(v)
  local n = tonumber(v)
  if not n or n ~= n or n == math.huge or n == -math.huge then return nil end
  return n
end
local function whole(lo, hi)
  return function(v)
    local n = number(v)
    return n and n == math.floor(n) and n >= lo and (not hi or n <= hi)
  end
end
local function one_of(...)
  local set = {}
  for _, s in ipairs({ ... }) do set[s] = true end
  return function(v) return set[v] end
end

-- name -> { accepts(value), what a valid value is }
M.rules = {
  FSDP_NUM_THREADS = { whole(1, 1e6), "a whole number of threads >= 1 (more than the pool's 256 are 256)" },
  FSDP_PEAK_TFLOPS = { function(v) local n = number(v); return n and n > 0 end,
                       "a positive number of TFLOP/s per device, as 989",
                       "FSDP_PEAK_TFLOPS must be a positive number of TFLOP/s per device, as 989 (got '%s')" },
  FSDP_DEVICE = { one_of("cpu", "cuda"), "cpu or cuda" },
  FSDP_WATCHDOG_SECONDS = { function(v) local n = number(v); return n and (n == 0 or n >= 1) and n <= 1e9 end,
                            "0 (no watchdog) or a number of seconds >= 1" },
  FSDP_TRACE_MAX_EVENTS = { whole(1), "a whole number of events >= 1" },
  FSDP_REPL_REJOIN_SECONDS = { function(v) local n = number(v); return n and n >= 0 end,
                               "a number of seconds >= 0" },
  FSDP_PROGRESS = { one_of("0", "1"), "0 or 1" },
  FSDP_VERBOSE = { one_of("0", "1"), "0 or 1" },
  FSDP_DEBUG_COLLECTIVES = { one_of("0", "1"), "0 or 1" },
  FSDP_NCCL_BLOCKING_WAIT = { one_of("0", "1"), "0 or 1" },
  FSDP_COMM_SYNC = { one_of("0", "1"), "0 or 1" },
}

--- problem([getenv]) -> nil, or a line naming the first variable (by name
-- order) whose value is not valid. An empty value counts as unset.
function M.problem(getenv)
  getenv = getenv or os.getenv
  local names = {}
  for name in pairs(M.rules) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local v = getenv(name)
    if v and v ~= "" and not M.rules[name][1](v) then
      local rule = M.rules[name]
      if rule[3] then return string.format(rule[3], v) end
      return string.format("%s=%s: expected %s", name, v, rule[2])
    end
  end
  return nil
end

return M
