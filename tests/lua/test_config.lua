-- Tests for --config=FILE (fsdp.options): the file's values under the
-- command line's, its errors, the resolved block, and the recipe: the
-- options printed, stored in --metrics and in checkpoints, and a resume
-- whose options differ from the checkpoint's naming each.
package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local options = require "fsdp.options"
local json = require "fsdp.json"

local tmp = os.tmpname()
os.remove(tmp)
os.execute("mkdir -p '" .. tmp .. "'")
local function write(name, text)
  local f = assert(io.open(tmp .. "/" .. name, "w"))
  f:write(text)
  f:close()
  return tmp .. "/" .. name
end

local schema = {
  { "steps", "int", 20, "training steps", min = 1 },
  { "lr", "number", 1e-3, "learning rate", min = 0 },
  { "strategy", { "full_shard", "no_shard" }, "full_shard", "sharding" },
  { "log_every", "int", 10, "log every N steps", min = 1 },
  { "name", "string", nil, "a name" },
}

-- precedence: the command line over the file over the defaults
local run = write("run.lua", "-- settings\nreturn { steps = 7, lr = 3e-4, ['log-every'] = 2, name = 'from file' }\n")
local o = options.parse({ config = run, steps = 9 }, schema, "r.lua")
t.eq(o.steps, 9, "the command line overrides the file")
t.eq(o.lr, 3e-4, "the file overrides the default")
t.eq(o.log_every, 2, "a dashed name in the file")
t.eq(o.strategy, "full_shard", "a default stays")
t.eq(o.name, "from file", "a string from the file")
t.eq(o.config, run, "o.config is the file")
local src = options.sources(o)
t.eq(src.steps, "command line", "source: command line")
t.eq(src.lr, "config", "source: config")
t.eq(src.strategy, "default", "source: default")
local block = options.describe(o, 60)
t.ok(block:find("^options: steps=9 lr=0.0003 strategy=full_shard log%-every=2") ~= nil, "the block: " .. block)
t.ok(block:find('name="from file"', 1, true) ~= nil, "the block quotes a string with spaces: " .. block)
t.ok(block:find("run.lua sets lr, log-every, name", 1, true) ~= nil, "the block says what the file set: " .. block)
for line in block:gmatch("[^\n]+") do t.ok(#line <= 60, "the block's lines fit the width: " .. line) end
t.eq(options.plain(o).lr, 3e-4, "plain copy")

-- errors, each one line naming the file and the option
local function fails(text, needles, what)
  local path = write("bad.lua", text)
  local err = t.raises(function() options.parse({ config = path }, schema, "r.lua") end, needles, what)
  if err then t.ok(not err:find("\n"), what .. ": one line: " .. err) end
end
fails("return { stpes = 3 }", { "r.lua: --config=", "bad.lua", "unknown option 'stpes'", "did you mean 'steps'?" },
      "an unknown name")
fails("return { lr = 'fast' }", { "--config=", "--lr expects a number, got 'fast'" }, "a value of the wrong type")
fails("return { steps = 0 }", { "--config=", "--steps must be at least 1, got 0" }, "out of range")
fails("return { strategy = 'ful_shard' }", { "did you mean 'full_shard'?" }, "a choice misspelt")
fails("return 5", { "must return a table of option values" }, "not a table")
fails("return { steps = ", { "bad.lua" }, "a syntax error")
fails("return { steps = os.time() }", { "'os' is not available in a config file" }, "no os")
fails("return { data = io.open('/etc/passwd'):read('*a') }", { "'io' is not available" }, "no io")
fails("return { steps = require('fsdp').rank() }", { "'require' is not available" }, "no require")
fails("while true do end", { "runs too long" }, "an endless loop ends")
fails("return { steps = {1} }", { "steps is a table" }, "a table value")
fails("return { config = 'x.lua' }", { "--config cannot be set in a config file" }, "config in config")
t.raises(function() options.parse({ config = tmp .. "/missing.lua" }, schema, "r.lua") end,
         { "--config=", "missing.lua", "No such file" }, "a missing file")

-- differences against a checkpoint's options
local diff = options.differences({ lr = 1e-3, steps = 30, resume = true, x = "a" }, { lr = 3e-4, steps = 20, y = 2 },
  { resume = true })
t.eq(table.concat(diff, "; "), "--lr=0.001 (the checkpoint's: 0.0003); --steps=30 (the checkpoint's: 20); "
  .. "--x=a (the checkpoint's: unset); --y=unset (the checkpoint's: 2)", "each differing option named")
t.eq(#options.differences({ lr = 1 }, { lr = 1 }), 0, "no differences")

-- the recipe: printed, in --metrics, in the checkpoint, and a resume that differs
local launcher = os.getenv("FSDP_TEST_LAUNCHER") or (arg and arg[-1])
local function sh(cmd)
  local p = io.popen(cmd .. " 2>&1")
  local out = p:read("*a")
  local ok = p:close()
  return (out:gsub("\n  +", " ")), ok   -- the options block's wrapped lines as one
end
local cfg = write("gpt.lua", "return { steps = 4, ['log-every'] = 2, eval_every = 0, sample = 0, lr = 3e-3, batch = 4 }")
local base = string.format("OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1 '%s' recipes/gpt2.lua --config=%s --ctx=16 "
  .. "--save-dir=%s/ck --metrics=%s/m.jsonl", launcher, cfg, tmp, tmp)
local out = sh(base .. " --save-every=2")
t.ok(out:find("\noptions: ", 1, true) == nil and out:find("^options: preset=tiny") ~= nil, "the options first: " .. out)
t.ok(out:find("steps=4 ", 1, true) ~= nil and out:find("lr=0.003", 1, true) ~= nil, "the file's values: " .. out)
t.ok(out:find("gpt.lua sets", 1, true) ~= nil and out:find("the command line sets", 1, true) ~= nil,
     "where they came from: " .. out)
t.ok(out:find("\ndone: 4 steps", 1, true) ~= nil, "the run used the file's steps: " .. out)
local first = json.decode(io.lines(tmp .. "/m.jsonl")())   -- (the first run's, read before the resumes)
t.eq(first.type, "config", "--metrics: the config line first")
t.eq(first.options.lr, 3e-3, "--metrics: the resolved lr")
t.eq(first.options.ctx, 16, "--metrics: the command line's ctx")
t.eq(first.ranks, 1, "--metrics: the ranks")
t.ok(type(first.run_id) == "string" and #first.run_id > 8, "--metrics: the run id")
local index = json.decode(assert(io.open(tmp .. "/ck/step_00000004/index.json")):read("*a"))
t.eq(index.extra.config.lr, 3e-3, "the checkpoint keeps the options")
t.eq(index.extra.config.steps, 4, "the checkpoint keeps the steps")
out = sh(base .. " --resume --steps=6 --lr=1e-3")
t.ok(out:find("--resume: 3 settings differ from the checkpoint's: --lr=0.001 (the checkpoint's: 0.003), "
  .. "--save-every=0 (the checkpoint's: 2), --steps=6 (the checkpoint's: 4)", 1, true) ~= nil,
  "the resume names each difference: " .. out)
t.ok(out:find("\ndone: 2 steps this run (5..6 of 6)", 1, true) ~= nil, "and goes on: " .. out)
out = sh(base .. " --resume --steps=6 --save-every=2")
t.ok(out:find("--resume: 1 setting differs from the checkpoint's: --steps=6 (the checkpoint's: 4)\n", 1, true) ~= nil,
     "one difference: " .. out)
out = sh(string.format("'%s' recipes/gpt2.lua --config=%s/nope.lua", launcher, tmp))
t.ok(out:find("gpt2.lua: --config=" .. tmp .. "/nope.lua: No such file", 1, true) ~= nil, "the recipe: a missing file: "
  .. out)

-- two ranks: the same one line, once, and exit status 2 (no rank left waiting)
local mpirun = os.getenv("FSDP_TEST_MPIRUN")
if mpirun and mpirun ~= "" then
  local bad = write("typo.lua", "return { stpes = 3 }")
  local text = sh(string.format("%s 2 '%s' recipes/gpt2.lua --config=%s 2>&1; echo \"rc=$?\"", mpirun, launcher, bad))
  local lines = {}
  for l in text:gmatch("[^\n]+") do if l:find("gpt2.lua:", 1, true) then lines[#lines + 1] = l end end
  t.eq(#lines, 1, "2 ranks: one message: " .. text)
  t.ok(text:find("unknown option 'stpes' (did you mean 'steps'?)", 1, true) ~= nil and text:find("rc=2", 1, true) ~= nil,
       "2 ranks: the message and exit status 2: " .. text)
end
os.execute("rm -rf '" .. tmp .. "'")
t.done()
