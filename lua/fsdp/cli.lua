-- fsdp.cli: the command line of fsdp-lua (the launcher calls main(argv)).
--
--   fsdp-lua [options] [script [--key=value ...]]
--
-- A recipe receives its options as a table: `local opts = ...` at its top
-- gets {steps = 10, lr = 0.01, name = "x", flag = true, [1] = positional}
-- from `--steps=10 --lr=0.01 --name=x --flag positional`.

local M = {}

M.usage = [==[
usage: fsdp-lua [options] [script [--key=value ...]]

Runs a Lua recipe on the fsdp engine, or starts an interactive REPL.

options:
  -e CODE        run CODE (repeatable; runs before the script)
  -l MODULE      require MODULE into the global of the same name
                 (the last part of a dotted name: -l fsdp.nn sets nn)
  -i             enter the REPL after running the script or -e code (the
                 fields of a table the script returns become globals)
  --plan         plan instead of training: run the recipe's first 2
                 training steps for real (its model, fsdp.shard, optimizer)
                 on the counting device, which computes nothing, and a
                 communicator that moves nothing, then print the memory per
                 tag, the units and the traffic and kernels per step
                 (fsdp.plan) and exit 0
  --world=N      the number of ranks --plan plans for (default: the ranks
                 this process runs with, 1 without mpirun); the recipe sees
                 fsdp.distributed.world() = N
  --rank=R       the rank --plan plans as (default 0, with the memory per
                 tag of the largest rank, as --metrics reports a real run)
  --device=D     the device --plan plans for, cpu or cuda: the kernel set
                 the op layer sees (default: this machine's default device;
                 cuda needs a build with the CUDA table, not a GPU)
  --link=RATE[,LATENCY]  --plan: the link between nodes (100Gbit,20us;
                 with --ranks-per-node=K, K ranks a node) for the
                 predicted step
  --memory=SIZE  --plan: whether a rank fits SIZE (80GiB), and if not,
                 which settings would make it fit
  --tune         --plan: search strategy, prefetch, limit, recompute, head
                 chunk, hpZ group and reduce dtype; the five fastest that
                 fit --memory, and the best's command line
  --all-ranks    --plan: play every rank and compare their collectives and
                 peaks (non-zero exit when they differ)
  --plan-json=FILE  --plan: the prediction and verdict as JSON
  --calibrate    measure this machine's kernels (under mpirun: one host's
                 collectives) for --plan's time model, into a cache file
  --trace=FILE   write a timeline of the run to FILE (Chrome/Perfetto trace
                 JSON: ops, collectives, waits and steps, one process per
                 rank; FSDP_TRACE=FILE does the same)
  --verbose      each rank says where it runs before the script: host,
                 local rank, device, threads (FSDP_VERBOSE=1 does the same)
  -v, --version  print the fsdp-lua, engine and LuaJIT versions
  -h, --help     print this help
  --             stop handling options
  -              read the script from stdin

The script gets its arguments as a table (`local opts = ...`):
  --key=value    opts.key = value (numbers converted, true/false as booleans;
                 dashes in keys become underscores)
  --flag         opts.flag = true     (--no-flag: opts.flag = false)
  word           opts[1], opts[2], ... in order
and the usual global `arg` (arg[0] the script, arg[1]... its arguments).

Without a script (and without -e or -v), fsdp-lua starts the REPL, also when
stdin is a pipe.

environment: FSDP_NUM_THREADS (threads per rank), FSDP_TRACE=FILE, FSDP_DEVICE=cpu,
FSDP_WATCHDOG_SECONDS and every other FSDP_* variable are listed, once, in
docs/environment.md of the source tree.

examples:
  fsdp-lua                                   # REPL, `fsdp` preloaded
  fsdp-lua recipes/mlp.lua --steps=500 --lr=0.1
  mpirun -np 4 fsdp-lua recipes/gpt2.lua --preset=small
  fsdp-lua --plan --world=8 recipes/gpt2.lua --preset=small --wrap=block
  fsdp-lua -e 'print(fsdp.randn(2, 3))'
  fsdp-lua -l fsdp -i recipes/mlp.lua --steps=10
  echo 'print(1 + 2)' | fsdp-lua -

environment:
  FSDP_LUA_PATH  extra Lua path (a folder or a package.path template), searched first
]==]

local function convert(v)
  if v == "true" then return true end
  if v == "false" then return false end
  return tonumber(v) or v
end

--- Options table from script arguments list[first..#list].
function M.parse_script_args(list, first)
  local opts = {}
  for i = first or 1, #list do
    local a = list[i]
    local key, value = a:match("^%-%-([^=]+)=(.*)$")
    if key then
      opts[(key:gsub("-", "_"))] = convert(value)
    elseif a:match("^%-%-no%-.") then
      opts[(a:sub(6):gsub("-", "_"))] = false
    elseif a:match("^%-%-.") then
      opts[(a:sub(3):gsub("-", "_"))] = true
    else
      opts[#opts + 1] = a
    end
  end
  return opts
end

local function fail(msg)
  io.stderr:write("fsdp-lua: ", msg, "\n")
  return 1
end

-- Exit status of a recipe stopped by a usage error (fsdp.options.fail).
local USAGE_EXIT = 2

local function version_line(fsdp)
  return string.format("fsdp-lua %s (engine %s, %s)", fsdp.version(), fsdp.version(), jit and jit.version or _VERSION)
end

-- os.exit ends the runtime first, so that a recipe exiting early under
-- mpirun neither leaves MPI unfinalized nor leaves other ranks waiting.
local function guard_exit()
  local C = require("fsdp.core").C
  local dist = require "fsdp.distributed"
  local raw_exit = os.exit
  os.exit = function(code, close)
    local n = (code == nil or code == true) and 0 or code == false and 1 or tonumber(code) or 1
    io.stdout:flush()
    if n ~= 0 and dist._ranks_running() > 1 then
      C.fsdp_runtime_abort(string.format("fsdp-lua: rank %d: os.exit(%d)", dist.rank(), n), n)
    end
    C.fsdp_runtime_finalize()
    raw_exit(code, close)
  end
end

-- Runs the recipe chunk: nil and what the recipe returned, or an exit
-- status. A usage error (a bad option, an unreadable file)
-- is one line from rank 0 and exit status 2. Any other
-- error is printed with its traceback, as the launcher prints errors, and
-- ends every rank.
local function run_recipe(chunk, args)
  local options = require "fsdp.options"
  local caught
  local result
  local ok, err = xpcall(function() result = chunk(args) end, function(e)
    if options.is_usage_error(e) then
      caught = e
      return e
    end
    return debug.traceback(tostring(e), 2)
  end)
  if ok then return nil, result end
  if caught then
    io.stdout:flush()
    if require("fsdp.distributed").rank() == 0 then io.stderr:write(caught.message, "\n") end
    return caught.status or USAGE_EXIT
  end
  local C, dist = require("fsdp.core").C, require "fsdp.distributed"
  local rank, world = dist.rank(), dist._ranks_running()
  local text = string.format("fsdp-lua: rank %d: %s", rank, tostring(err))
  io.stdout:flush()
  if world > 1 then C.fsdp_runtime_abort(text, 1) end   -- ends every rank
  io.stderr:write(text, "\n")
  return 1
end

function M.main(argv)
  argv = argv or {}
  local env_problem = require("fsdp.env_check").problem()
  if env_problem then io.stderr:write("fsdp-lua: ", env_problem, "\n"); return USAGE_EXIT end
  local actions, interactive, show_version, script = {}, false, false, nil
  local verbose = os.getenv("FSDP_VERBOSE") == "1"
  local plan, plan_world, plan_rank, plan_device = false, nil, nil, nil
  local plan_extra, calibrate = {}, false   -- (fsdp.plan_cli's options)
  local plan_cli_opts = { link = "value", ranks_per_node = "value", plan_json = "value", memory = "value",
    tune = "flag", all_ranks = "flag" }   -- (read by fsdp.plan_cli)
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "-e" or a == "-l" then
      if argv[i + 1] == nil then return fail(a .. " needs an argument (see --help)") end
      actions[#actions + 1] = { a, argv[i + 1] }
      i = i + 2
    elseif a == "-i" then
      interactive, i = true, i + 1
    elseif a == "-v" or a == "--version" then
      show_version, i = true, i + 1
    elseif a == "--verbose" then
      verbose, i = true, i + 1
    elseif a == "--plan" then
      plan, i = true, i + 1
    elseif a:match("^%-%-world=") or a == "--world" then
      local v = a:match("^%-%-world=(.*)$")
      local n = tonumber(v)
      if not n or n < 1 or n ~= math.floor(n) or n == math.huge then
        return fail("--world expects a positive whole number of ranks, as --world=8 (got '" .. tostring(v) .. "')")
      end
      plan_world, i = n, i + 1
    elseif a:match("^%-%-rank=") or a == "--rank" then
      local v = a:match("^%-%-rank=(.*)$")
      local n = tonumber(v)
      if not n or n < 0 or n ~= math.floor(n) or n == math.huge then
        return fail("--rank expects a whole number, as --rank=3 (got '" .. tostring(v) .. "')")
      end
      plan_rank, i = n, i + 1
    elseif a:match("^%-%-device=") then
      plan_device = a:match("^%-%-device=(.*)$")
      if plan_device ~= "cpu" and plan_device ~= "cuda" then
        return fail("--device expects cpu or cuda (got '" .. plan_device .. "')")
      end
      i = i + 1
    elseif a == "--calibrate" then
      calibrate, i = true, i + 1
    elseif a:match("^%-%-[%a-]+") and plan_cli_opts[a:match("^%-%-([%a-]+)"):gsub("-", "_")] then
      local name, v = a:match("^%-%-([%a-]+)=?(.*)$")
      local key = name:gsub("-", "_")
      if plan_cli_opts[key] == "value" and not a:find("=", 1, true) then
        return fail("--" .. name .. " needs a value, as --" .. name .. "=... (see --help)")
      end
      plan_extra[key] = plan_cli_opts[key] == "flag" or v
      plan_extra.given = (plan_extra.given or "") .. " " .. a
      i = i + 1
    elseif a == "-h" or a == "--help" then
      io.stdout:write(M.usage)
      return 0
    elseif a == "--" then
      i = i + 1
      script = argv[i]
      break
    elseif a ~= "-" and a:sub(1, 1) == "-" then
      return fail("unknown option " .. a .. " (see --help)")
    else
      script = a
      break
    end
  end

  if plan_world and not plan then return fail("--world=N only applies with --plan (see --help)") end
  if plan_rank and not plan then return fail("--rank=R only applies with --plan (see --help)") end
  if plan_device and not plan then return fail("--device=D only applies with --plan (see --help)") end
  if plan and not script then return fail("--plan needs a recipe that calls fsdp.shard (see --help)") end
  if next(plan_extra) and not plan then
    return fail((plan_extra.given:match("^ (%S+)")) .. " only applies with --plan (see --help)")
  end

  local fsdp = require "fsdp"
  _G.fsdp = fsdp   -- for -e code and the REPL; recipes require it themselves
  guard_exit()
  if show_version then print(version_line(fsdp)) end
  if verbose then require("fsdp.placement").report() end
  if calibrate then
    require("fsdp.calibrate").run()
    return 0
  end

  for _, act in ipairs(actions) do
    if act[1] == "-l" then
      local name = act[2]
      _G[name:match("[^.]+$")] = require(name)
    else
      local chunk, err = loadstring(act[2], "=(command line)")
      if not chunk then error(err, 0) end
      chunk()
    end
  end

  if script then
    local chunk, err
    if script == "-" then
      chunk, err = load(function() return io.stdin:read(4096) end, "=stdin")
    else
      local why = require("fsdp.io").file_problem(script)
      if why and not script:find("/", 1, true) then   -- a bare name: a shipped recipe of that name
        local shipped = require("fsdp.shipped").path("recipes/" .. script)
        if not require("fsdp.io").file_problem(shipped) then script, why = shipped, nil end
      end
      if why then
        -- the engine's reason names the path and rank again: keep its cause
        why = why:gsub("^cannot open: '.-': ", ""):gsub("%s*%[rank %d+%]$", "")
        return fail(string.format("cannot open recipe '%s': %s", script, why))
      end
      local f, oerr = io.open(script, "r")
      if not f then
        return fail(string.format("cannot open recipe '%s': %s", script, (oerr:gsub("^.-: ", ""))))
      end
      f:close()
      chunk, err = loadfile(script)
    end
    if not chunk then error(err, 0) end
    io.stdout:setvbuf("line")   -- log lines arrive as they are printed, also through a pipe
    local args = M.parse_script_args(argv, i + 1)
    if plan then
      local n = plan_world or fsdp.distributed.world()
      local r = plan_rank or 0
      if r >= n then return fail(string.format("--rank=%d is not a rank of --world=%d (0..%d)", r, n, n - 1)) end
      local planner, plan_cli = require "fsdp.plan", require "fsdp.plan_cli"
      local popts, why = plan_cli.check(plan_extra, n)
      if not popts then return fail(why) end
      popts.world, popts.device, popts.link_text = n, plan_device, plan_extra.link
      local p
      -- without --rank: memory as the largest rank holds it, as --metrics reports a real run
      local code = run_recipe(function(a)
        p = planner.run(chunk, { world = n, rank = r, mimic = plan_device, all_ranks = plan_rank == nil }, a)
      end, args)
      if code then return code end
      io.stdout:write(planner.format(p), "\n")
      return plan_cli.report(chunk, args, popts, p, script)
    end
    local code, result = run_recipe(chunk, args)
    if code then return code end
    -- -i: what the recipe returned (a table of its main objects) becomes globals of the REPL
    if interactive and type(result) == "table" then
      local names = {}
      for k, v in pairs(result) do
        if type(k) == "string" and k:match("^[%a_][%w_]*$") then
          _G[k] = v
          names[#names + 1] = k
        end
      end
      table.sort(names)
      if #names > 0 and require("fsdp.distributed").rank() == 0 then
        io.stderr:write("fsdp-lua: the recipe left ", table.concat(names, ", "), " for the REPL\n")
      end
    end
  end

  if interactive or (not script and #actions == 0 and not show_version) then
    local code = require("fsdp.repl").run()
    if code then return code end
  end
  return 0
end

return M
