-- Tests for fsdp.progress: the bar's text, off when stderr is not a
-- terminal, and the bar a checkpoint save draws by default.
package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local progress = require "fsdp.progress"

t.eq(progress.line("save", 512, 1024, 2), "save [###############...............]  50% 512 B / 1.0 KiB 256 B/s",
     "half way")
t.eq(progress.line("load", 3 * 2 ^ 30, 3 * 2 ^ 30, 1.5),
     "load [##############################] 100% 3.00 GiB / 3.00 GiB 2.00 GiB/s", "done")
t.eq(progress.line("x", 0, 0, 0), "x [##############################] 100% 0 B / 0 B 0 B/s", "nothing to do")
t.eq(progress.size(1536), "1.5 KiB", "sizes")
t.eq(progress.line("plan", 0.5, 2, 0.4, "steps"), "plan [########......................]  25% 0.5 / 2 steps 1.25 steps/s",
     "counts of steps")
t.eq(progress.line("plan", 2, 2, 4, "steps"), "plan [##############################] 100% 2 / 2 steps 0.5 steps/s",
     "counts of steps, done")

local launcher = os.getenv("FSDP_TEST_LAUNCHER") or (arg and arg[-1])
local tmp = os.tmpname()
os.remove(tmp)
local function run(env)
  local code = string.format([[
    local nn = require "fsdp.nn"
    local s = fsdp.shard(nn.Linear(64, 64))
    fsdp.save(%q, { model = s })
    io.stderr:write("saved\n")
  ]], tmp .. "/ckpt" .. env:gsub("%W", ""))
  local p = io.popen(string.format("%s '%s' -e %q 2>&1 >/dev/null", env, launcher, code))
  local out = p:read("*a")
  p:close()
  return out
end
-- this test's stderr is not a terminal: no bar unless forced
local plain = run("FSDP_PROGRESS=")
t.ok(plain:find("saved", 1, true) and not plain:find("save [", 1, true), "no bar when stderr is not a terminal: " .. plain)
local forced = run("FSDP_PROGRESS=1")
t.ok(forced:find("save [", 1, true) ~= nil, "a bar when forced: " .. forced)
t.ok(forced:find("100%", 1, true) ~= nil and forced:find("/s *\n") ~= nil, "the bar ends at 100% with a rate")
local off = run("FSDP_PROGRESS=0")
t.ok(not off:find("save [", 1, true), "FSDP_PROGRESS=0 turns bars off")
-- the planner: a bar over its steps on a terminal, nothing otherwise
local function plan(env)
  local p = io.popen(string.format("%s '%s' --plan --world=2 recipes/gpt2.lua --preset=tiny 2>&1 >/dev/null", env,
                                   launcher))
  local out = p:read("*a")
  p:close()
  return out
end
local bar = plan("FSDP_PROGRESS=1")
t.ok(bar:find("\rplan [", 1, true) and bar:find("100% 2 / 2 steps", 1, true) and bar:sub(-1) == "\n",
     "--plan draws its steps when forced: " .. bar)
t.ok(not plan("FSDP_PROGRESS="):find("plan [", 1, true), "--plan draws nothing when stderr is not a terminal")
-- a redraw covers all of the line before it (a shorter rate leaves no tail)
do
  local progress = require "fsdp.progress"
  local saved_err, saved_enabled, saved_interval = io.stderr, progress.enabled, progress.INTERVAL
  local written = {}
  io.stderr = { write = function(self, ...) for _, s in ipairs({ ... }) do written[#written + 1] = s end end,
                flush = function() end }
  progress.enabled, progress.INTERVAL = function() return true end, 0
  local timer = require "fsdp.timer"
  local saved_now, clock = timer.now, 0
  timer.now = function() return clock end
  local b = progress.bar("load")
  clock = 1
  b(900 * 2 ^ 20, 2 ^ 30)   -- 900.0 MiB/s
  clock = 100
  b(901 * 2 ^ 20, 2 ^ 30)   -- 9.0 MiB/s: two columns shorter
  io.stderr, progress.enabled, progress.INTERVAL, timer.now = saved_err, saved_enabled, saved_interval, saved_now
  local lines = {}
  for seg in table.concat(written):gmatch("\r([^\r]*)") do lines[#lines + 1] = seg end
  t.eq(#lines, 2, "two redraws")
  t.ok(#lines[2] >= #lines[1], string.format("the second covers the first (%d >= %d columns)", #lines[2], #lines[1]))
  t.ok(lines[2]:find("901.0 MiB / 1.00 GiB", 1, true) ~= nil, "the second is the new figure: " .. lines[2])
end
-- what a terminal shows: \r to the line's start, characters overwrite,
-- ESC[K erases to the end, \n a new line
local function screen(bytes)
  local lines, cur, col = {}, {}, 1
  local i = 1
  while i <= #bytes do
    local c = bytes:sub(i, i)
    if c == "\r" then col = 1
    elseif c == "\n" then lines[#lines + 1], cur, col = table.concat(cur):gsub(" +$", ""), {}, 1
    elseif bytes:sub(i, i + 2) == "\27[K" then
      for j = col, #cur do cur[j] = nil end
      i = i + 2
    else cur[col], col = c, col + 1 end
    i = i + 1
  end
  if #cur > 0 then lines[#lines + 1] = table.concat(cur):gsub(" +$", "") end
  return lines
end
-- two bars on one line: the first stopped without ending its line (a save
-- cut short), the second's shorter text leaves none of the first behind
do
  local saved_err, saved_enabled, saved_interval = io.stderr, progress.enabled, progress.INTERVAL
  local written = {}
  io.stderr = { write = function(self, ...) for _, x in ipairs({ ... }) do written[#written + 1] = x end end,
                flush = function() end }
  progress.enabled, progress.INTERVAL = function() return true end, 0
  local timer = require "fsdp.timer"
  local saved_now, clock = timer.now, 0
  timer.now = function() return clock end
  local a = progress.bar("save")
  clock = 1
  a(1600 * 2 ^ 20, 4 * 2 ^ 30)   -- 1.56 GiB/s, never finished
  local b = progress.bar("save")
  clock = 2
  b(512, 2 ^ 30)                  -- 512 B/s: shorter
  local mid = screen(table.concat(written))
  clock = 3
  b(2 ^ 30, 2 ^ 30)
  io.stderr, progress.enabled, progress.INTERVAL, timer.now = saved_err, saved_enabled, saved_interval, saved_now
  local shown = screen(table.concat(written))
  t.eq(#shown, 1, "one line on the screen")
  t.eq(mid[1], progress.line("save", 512, 2 ^ 30, 1), "the shorter redraw alone, nothing of the first left")
  t.eq(shown[1], progress.line("save", 2 ^ 30, 2 ^ 30, 2), "the last text alone at the end")
  t.ok(not shown[1]:find("/s/s", 1, true), "no '/s/s': " .. tostring(shown[1]))
  -- a redraw on a terminal also erases to the end of the line (ESC[K), tested by its bytes
  t.eq(screen("\rabcdef\rxy\27[K\n")[1], "xy", "the screen model erases with ESC[K")
end
-- no silent phases: GPT-2 124M says when it builds, shards, evaluates and
-- samples (stdout), and draws the evaluation's and the sampling's bars (stderr)
-- (on the CPU: the figures are the same on any device, and 124M is slow on an emulated one)
do
  local cmd = string.format("OPENBLAS_NUM_THREADS=1 FSDP_DEVICE=cpu FSDP_PROGRESS=1 '%s' recipes/gpt2.lua --preset=small --steps=1 "
    .. "--batch=1 --ctx=8 --sample=2 --eval-every=1 --eval-steps=2 --log-every=1", launcher)
  local p = io.popen(cmd .. " 2>" .. tmp .. ".err")
  local out = p:read("*a")
  p:close()
  local f = io.open(tmp .. ".err")
  local err = f and f:read("*a") or ""
  if f then f:close() end
  os.remove(tmp .. ".err")
  local order = { "\nbuilding the gpt small model ...\n", "\nsharding it over 1 rank(s) (full_shard, wrap block) ...\n",
    "\nbuilt and sharded in ", "\nstep     1 | evaluating on 2 batches ...\n", "\nstep     1 | eval loss ",
    "\nsampling 1 x 2 tokens ...\n", "\nsample 1/1 after step 1" }
  local at = 1
  for _, want in ipairs(order) do
    local i = out:find(want, at, true)
    t.ok(i ~= nil, "status line, in order: " .. want:gsub("\n", "") .. (i and "" or ("\n" .. out)))
    at = i or at
  end
  t.ok(err:find("\reval [", 1, true) and err:find("100% 2 / 2 batches", 1, true), "the evaluation's bar: " .. err)
  t.ok(err:find("\rsample [", 1, true) and err:find("100% 2 / 2 tokens", 1, true), "the sampling's bar: " .. err)
  for _, line in ipairs(screen(err)) do
    t.ok(not line:find("/s.*/s"), "each bar's last state alone on its line: " .. line)
  end
end
os.execute("rm -rf '" .. tmp .. "'")
t.done()
