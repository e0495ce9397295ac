-- The planner beyond memory: planning reads no data (synthetic token ids of
-- the asked shape), the recipe's own log lines stay quiet.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local data = require "fsdp.data"

-- ---- synthetic data: the shape and vocabulary asked, nothing read ----
local was = data.synthetic(true)
t.eq(was, false, "synthetic data is off by default")
local train = data.open("no/such/file.txt", "train", { batch = 6, ctx = 5, world = 3, rank = 1, seed = 0 })
local x, y = train:next()
t.eq(table.concat(x:shape(), "x"), "2x5", "synthetic: this rank's rows of the batch, ctx columns")
t.eq(table.concat(y:shape(), "x"), "2x5", "synthetic: targets of the same shape")
local xs, ys = x:tolist(), y:tolist()
t.eq(ys[1][1], xs[1][2], "synthetic: targets are the ids shifted by one")
local top = 0
for _, row in ipairs(xs) do for _, v in ipairs(row) do top = math.max(top, v) end end
t.ok(top < 256 and top > 0, "synthetic ids of a text file lie below its 256 byte tokens, got max " .. top)
local shards = data.open("no/such/dir/*.bin", "val", { batch = 1, ctx = 4000, seed = 0 })
local sx = shards:next()
top = 0
for _, v in ipairs(sx:tolist()[1]) do top = math.max(top, v) end
t.ok(top >= 256 and top < data.GPT2_VOCAB, "synthetic ids of token shards lie below GPT-2's vocabulary, got max " .. top)
t.ok(shards:state().windows > 0, "synthetic loaders have a resumable state")
data.synthetic(false)
t.raises(function() data.open("no/such/file.txt", "train", { batch = 1, ctx = 4, what = "x" }) end,
  { "no/such/file.txt" }, "off again: a missing file is refused")

-- ---- the command line ----
local launcher = os.getenv("FSDP_TEST_LAUNCHER")
if not launcher then
  io.stderr:write("FSDP_TEST_LAUNCHER is not set: skipping the command line checks\n")
  t.done()
  return
end
local function run(cmd)
  local f = io.popen(cmd .. " 2>&1; echo \"exit=$?\"")
  local out = f:read("*a")
  f:close()
  return out, tonumber(out:match("exit=(%d+)%s*$"))
end

-- a batch the bundled corpus is too short for, and a --data that does not exist
local out, code = run(launcher .. " --plan --world=8 recipes/gpt2.lua --preset=small --batch=64 --ctx=1024")
t.eq(code, 0, "--plan --batch=64 --ctx=1024 on the bundled corpus exits 0" .. (code == 0 and "" or "\n" .. out))
t.ok(not out:find("traceback", 1, true), "--plan: no traceback")
t.ok(not out:find("step +%d+ |") and not out:find("MFU against", 1, true),
  "--plan: the recipe's log lines are not printed")
out, code = run(launcher .. " --plan --world=2 recipes/gpt2.lua --data=no/such/shards --batch=2 --ctx=16")
t.eq(code, 0, "--plan with a --data that does not exist exits 0" .. (code == 0 and "" or "\n" .. out))
t.ok(out:find("FSDP plan: 2 ranks", 1, true), "--plan with any --data prints the plan")

t.done()
