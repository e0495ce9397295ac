-- Fuzzed option and environment values (bounded, seeded): recipes/gpt2.lua
-- launched --cases times, each with one bad value: a number option given
-- nan, inf, -inf, 1e999, a word, nothing, a value below its minimum or (for
-- a whole number) a fraction; or one FSDP_* variable given a value outside
-- what it accepts. Every case must end within the timeout, with a non-zero
-- exit, no traceback, and a one-line message naming the option or the
-- variable, before any training step.
--   fsdp-lua tests/fuzz/test_fuzz_options.lua --cases=40 --seed=1
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"

local opts = ... or {}
local ncases = tonumber(opts.cases or 40)
local seed = tonumber(opts.seed or 1)
local exe = opts.exe or (arg and arg[-1]) or "build/fsdp-lua"

local state = seed * 2654435761 % 4294967296
local function rand(n)   -- 1..n
  state = (state * 1103515245 + 12345) % 2147483648
  return math.floor(state / 65536) % n + 1
end
local function pick(list) return list[rand(#list)] end

-- all have a minimum of 0 or 1, so -1 is always below it
local number_options = { "lr", "min-lr", "wd", "clip", "topk-density" }
local int_options = { "steps", "batch", "ctx", "warmup", "seed", "eval-every", "head-chunk", "log-every", "accum" }
local bad_numbers = { "nan", "NaN", "inf", "-inf", "1e999", "-1e999", "abc", "", "-1", "1x", "0x" }
local bad_env = {
  FSDP_NUM_THREADS = { "0", "-2", "abc", "1.5", "nan", "inf" },
  FSDP_PEAK_TFLOPS = { "0", "-1", "nan", "inf", "fast" },
  FSDP_DEVICE = { "gpu", "CPU", "1" },
  FSDP_WATCHDOG_SECONDS = { "0.5", "soon", "inf", "-1", "nan" },
  FSDP_TRACE_MAX_EVENTS = { "0", "many", "1.5", "-4" },
  FSDP_REPL_REJOIN_SECONDS = { "-1", "soon", "nan" },
  FSDP_PROGRESS = { "yes", "2" },
  FSDP_COMM_SYNC = { "yes", "on" },
}
local env_names = {}
for name in pairs(bad_env) do env_names[#env_names + 1] = name end
table.sort(env_names)

local function sh_quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

local counts, failures = { option = 0, env = 0 }, 0
for case = 1, ncases do
  local env, arg_extra, needle = "", "", nil
  if rand(2) == 1 then
    local name, v
    if rand(3) == 1 then
      name = pick(int_options)
      v = rand(2) == 1 and pick(bad_numbers) or pick({ "1.5", "2.25", "-3" })
    else
      name = pick(int_options) == "steps" and "lr" or pick(number_options)
      v = pick(bad_numbers)
    end
    arg_extra, needle = sh_quote("--" .. name .. "=" .. v), "--" .. name
    counts.option = counts.option + 1
  else
    local name = pick(env_names)
    env, needle = name .. "=" .. sh_quote(pick(bad_env[name])) .. " ", name
    counts.env = counts.env + 1
  end
  local cmd = string.format("%stimeout 60 %s recipes/gpt2.lua --preset=tiny --steps=1 --sample=0 --eval-every=0 %s 2>&1; echo \"exit=$?\"",
                            env, sh_quote(exe), arg_extra)
  local p = io.popen(cmd)
  local out = p:read("*a")
  p:close()
  local rc = tonumber(out:match("exit=(%d+)%s*$"))
  local body = out:gsub("exit=%d+%s*$", "")
  local lines = {}
  for line in body:gmatch("[^\n]+") do lines[#lines + 1] = line end
  local named = 0
  for _, line in ipairs(lines) do if line:find(needle, 1, true) then named = named + 1 end end
  local ok = rc and rc ~= 0 and rc ~= 124 and rc ~= 137 and not body:find("traceback", 1, true)
    and not body:find("step 1/", 1, true) and #lines == 1 and named == 1
  if not ok then
    failures = failures + 1
    t.ok(false, string.format("case %d: %s%s -> exit %s, output:\n%s", case, env, arg_extra, tostring(rc), body))
  end
end
t.ok(counts.option > 0 and counts.env > 0, "both kinds tried")
print(string.format("fuzz.options: %d cases (%d option values, %d environment values), %d not refused in one line",
                    ncases, counts.option, counts.env, failures))
t.eq(failures, 0, "every bad value refused promptly, in one line naming it")
t.done()
