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

-- ---- the timeline: what the dry run records, against its own counters ----
local nn = require "fsdp.nn"
local planner = require "fsdp.plan"
local pt = require "fsdp.plan_time"
local cfg = { vocab_size = 256, n_layer = 2, n_head = 4, n_embd = 64, block_size = 16 }
for _, case in ipairs({ { 3, "full_shard" }, { 4, "hybrid_shard", 2 } }) do
  local N, strategy, G = case[1], case[2], case[3]
  local tag = string.format("N=%d %s", N, strategy)
  local p = planner.plan(nn.GPT(cfg), { policy = fsdp.policy.per_block(), strategy = strategy, group_size = G }, N,
    { progress = false })
  local flops, launches, issued, waited, gathered, reduced = 0, 0, {}, {}, 0, 0
  local levels = {}
  for _, ev in ipairs(p.timeline) do
    if ev.type == "kernel" then
      flops, launches = flops + ev.flops, launches + ev.launches
    elseif ev.type == "issue" then
      issued[ev.comm .. ":" .. ev.seq] = ev
      if ev.kind == "all_gather" then gathered = gathered + ev.bytes end
      if ev.kind == "reduce_scatter" or ev.kind == "all_reduce" then reduced = reduced + ev.bytes end
      levels[string.format("%d/%d/%d", ev.size, ev.first, ev.stride)] = true
    else
      t.ok(issued[ev.comm .. ":" .. ev.seq] ~= nil, tag .. ": a wait follows the issue of its collective")
      waited[ev.comm .. ":" .. ev.seq] = true
    end
  end
  t.eq(flops, p.kernels.flops, tag .. ": the timeline's FLOPs are the step's counted FLOPs")
  t.eq(launches, p.kernels.launches, tag .. ": the timeline's launches are the step's")
  t.eq(gathered, p.traffic.gathered_bytes, tag .. ": the timeline's all-gathered bytes are the step's traffic")
  t.eq(reduced, p.traffic.reduced_bytes, tag .. ": the timeline's reduced bytes are the step's traffic")
  local n_waited = 0
  for _ in pairs(waited) do n_waited = n_waited + 1 end
  t.ok(n_waited > 0, tag .. ": waits are recorded")
  if G then
    -- rank 0's shard group is ranks {0, 1}, its replicas {0, 2}: the levels the comm model tells apart
    t.ok(levels["2/0/1"] and levels["2/0/2"], tag .. ": the shard group (2 ranks from 0, stride 1) and the replica "
      .. "group (stride 2) are told apart")
    -- each unit's replica average is issued right behind its reduce-scatter (the same unit's label), so it
    -- runs during the rest of the backward, not after the walk
    local coll, behind, rs = {}, 0, 0
    for _, ev in ipairs(p.timeline) do
      if ev.type == "issue" and ev.kind ~= "all_reduce_doubles" then coll[#coll + 1] = ev end
    end
    for i, ev in ipairs(coll) do
      if ev.kind == "reduce_scatter" then
        rs = rs + 1
        local nx = coll[i + 1]
        if nx and nx.kind == "all_reduce" and nx.stride == 2 and nx.label == ev.label then behind = behind + 1 end
      end
    end
    t.ok(rs >= 3, tag .. ": a reduce-scatter per unit, got " .. rs)
    t.eq(behind, rs, tag .. ": every reduce-scatter is followed at once by its unit's replica all-reduce")
  else
    t.ok(levels["3/0/1"], tag .. ": the world's collectives span ranks 0..2")
  end
end

-- ---- the replay, against a schedule worked out by hand ----
local function K(ms) return { type = "kernel", ms = ms } end
local function I(id, ms) return { type = "issue", comm = 1, seq = id, ms = ms } end
local function W(id) return { type = "wait", comm = 1, seq = id } end
local price = function(ev) return ev.ms / 1e3 end
-- compute 1, A issued (2), compute 1, wait A: held 1 ms (A ends at 3);
-- B (1) and C (1) queue behind each other: C ends at 3 + 1 + 1 = 5,
-- compute runs to 4, the wait for C holds 1 ms more
local r = pt.replay({ K(1), I(1, 2), K(1), W(1), I(2, 1), I(3, 1), K(1), W(3), W(2) }, price, price)
t.near(r.step, 5e-3, 1e-12, "replay: the step ends when the last wait returns")
t.near(r.compute, 3e-3, 1e-12, "replay: compute is the kernels' sum")
t.near(r.communication, 4e-3, 1e-12, "replay: communication is the comm queue's busy time")
t.near(r.exposed, 2e-3, 1e-12, "replay: exposed is what the waits held")
-- a collective waited for long after it finished holds nothing
r = pt.replay({ I(1, 1), K(5), W(1) }, price, price)
t.near(r.exposed, 0, 1e-15, "replay: a collective hidden behind compute is not exposed")

-- ---- the comm model's bytes on the wire ----
local link, intra = { rate = 1e9, latency = 10e-6 }, { rate = 4e9, latency = 1e-6 }
local cm = pt.comm_model { link = link, intra = intra, ranks_per_node = 2 }
local B = 8 * 2 ^ 20
-- all-gather over 2 ranks of one node: (n-1)/n of the output, 1 ring step + 2 agreement steps
t.near(cm({ kind = "all_gather", bytes = B, size = 2, first = 0, stride = 1 }), 3 * 1e-6 + (B / 2) / 4e9, 1e-12,
  "comm model: an all-gather inside a node")
-- over 4 ranks on 2 nodes: the ring crosses the link with 3/4 of the output; 3 steps + 4 agreement steps
t.near(cm({ kind = "all_gather", bytes = B, size = 4, first = 0, stride = 1 }), 7 * 10e-6 + (3 * B / 4) / 1e9, 1e-12,
  "comm model: an all-gather across nodes")
-- the pairwise reduce-scatter: a node's 2 ranks each send the 2 blocks of the other node
t.near(cm({ kind = "reduce_scatter", bytes = B, size = 4, first = 0, stride = 1 }), 2 * 10e-6 + 4 * 10e-6
  + (2 * B * 2 / 4) / 1e9, 1e-12, "comm model: a reduce-scatter across nodes")
-- stride 2 on 2 ranks a node: every member on another node
t.near(cm({ kind = "all_reduce", bytes = B, size = 2, first = 0, stride = 2 }), (1 + 2) * 10e-6 + B / 1e9, 1e-12,
  "comm model: an all-reduce across nodes (a replica group)")

-- ---- the calibrated roofline, from a stated cache ----
local cal_path = os.tmpname()
local cf = io.open(cal_path, "w")
cf:write(require("fsdp.json").encode({ version = 1, cpu = { ["1"] = { threads = 1, per_call = 2e-6,
  rates = { elementwise = 1e9, gemm_f32 = 1e10, attention = 5e9, norm = 5e8 },
  gemm_small = { flops = 2 * 64 ^ 3, rate = 1e9 }, gemm_large_flops = 2 * 512 ^ 3 } },
  intra = { latency = 5e-6, rate = 2e9, ranks = 2 } }), "\n")
cf:close()
local cal = require "fsdp.calibrate"
local saved_path = cal.path
cal.path = function() return cal_path end
local kprice = pt.compute_model("cpu", 1)
t.near(kprice({ family = "norm", name = "layernorm_forward_f32", rd = 1e6, wr = 1e6, flops = 8e5, launches = 1 }),
  2e-6 + 2e6 / 5e8, 1e-15, "roofline: a memory-bound family at its own rate")
t.near(kprice({ family = "gemm_f32", name = "matmul_f32", rd = 1e3, wr = 1e3, flops = 2 * 512 ^ 3, launches = 1 }),
  2e-6 + 2 * 512 ^ 3 / 1e10, 1e-15, "roofline: a large GEMM at the large rate")
t.near(kprice({ family = "gemm_f32", name = "matmul_f32", rd = 1e3, wr = 1e3, flops = 2 * 64 ^ 3, launches = 1 }),
  2e-6 + 2 * 64 ^ 3 / 1e9, 1e-15, "roofline: a small GEMM at the small rate")
t.near(kprice({ family = "copy", name = "copy_strided", rd = 3e6, wr = 1e6, flops = 0, launches = 1 }),
  2e-6 + 4e6 / 1e9, 1e-15, "roofline: a family no probe measured takes its stand-in's rate")
cal.path = saved_path

-- ---- what the command line reads ----
local l = pt.parse_link("100Gbit,20us")
t.near(l.rate, 100e9 / 8, 1e-3, "--link: 100Gbit in bytes/s")
t.near(l.latency, 20e-6, 1e-15, "--link: 20us")
t.near(pt.parse_link("12.5GB/s,0.5ms").latency, 5e-4, 1e-15, "--link: a latency in ms")
t.ok(pt.parse_link("fast") == nil and pt.parse_link("0Gbit") == nil and pt.parse_link("10Gbit,soon") == nil,
  "--link: a bad rate or latency is refused")
t.eq(pt.parse_size("80GiB"), 80 * 2 ^ 30, "--memory: 80GiB")
t.eq(pt.parse_size("1.5GB"), 1500000000, "--memory: 1.5GB")
t.ok(pt.parse_size("lots") == nil and pt.parse_size("-1GiB") == nil, "--memory: a bad size is refused")

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


-- the prediction, the verdict, the search, every rank, with the stated calibration
local env = "FSDP_CALIBRATION=" .. cal_path .. " "
local job = " tests/lua/plan_job.lua"
out, code = run(env .. launcher .. " --plan --world=2 --plan-json=" .. cal_path .. ".json" .. job)
t.eq(code, 0, "--plan with a calibration exits 0" .. (code == 0 and "" or "\n" .. out))
local step, comp, comm, exposed = out:match("predicted step: ([%d.]+) ms %(compute ([%d.]+), communication ([%d.]+), "
  .. "exposed ([%d.]+)%)")
t.ok(step ~= nil, "--plan prints the predicted step" .. (step and "" or "\n" .. out))
local jf = io.open(cal_path .. ".json")
local js = jf and require("fsdp.json").decode(jf:read("*a"))
if jf then jf:close() end
os.remove(cal_path .. ".json")
t.ok(js and js.predicted and math.abs(js.predicted.step_ms - tonumber(step or 0)) < 0.01
  and math.abs(js.predicted.exposed_ms - tonumber(exposed or 0)) < 0.01, "--plan-json holds the printed prediction")
t.ok(tonumber(step or 0) >= tonumber(comp or 0) and tonumber(exposed or 0) <= tonumber(comm or 0),
  "the step is at least its compute; exposed at most the communication")
out, code = run(env .. launcher .. " --plan --world=2 --memory=1GiB" .. job)
t.ok(code == 0 and out:find("fits: yes (peak ", 1, true) and out:find(" of 1.00 GiB)", 1, true), "--memory: fits: yes")
out, code = run(env .. launcher .. " --plan --world=2 --memory=4MiB recipes/gpt2.lua --preset=tiny")
t.ok(out:find("fits: no (peak ", 1, true) and out:find(", over by ", 1, true), "--memory: fits: no, over by"
  .. "\n" .. out)
-- (which settings fit depends on the schedule; the step's change is signed:
-- on calibrated rates taken under load a setting may come out shorter)
t.ok(out:find("\n  %-%-[%w%- =.]+: peak %-[%d.]+ MiB %([%d.]+ MiB%), step [%+%-]%d+%% %([%d.]+ ms%)") ~= nil,
  "--memory: a setting that would fit, with its peak and step\n" .. out)
out, code = run(env .. launcher .. " --plan --world=4 --tune --memory=64MiB recipes/gpt2.lua --preset=tiny")
t.ok(code == 0 and out:find("\nbest: mpirun %-np 4 fsdp%-lua recipes/gpt2.lua ") ~= nil, "--tune: a best line"
  .. (code == 0 and "" or "\n" .. out))
local rows = 0
for _ in out:gmatch("\n +[%d.]+ ms +[%d.]+ [MG]iB +[%d.]+ MiB") do rows = rows + 1 end
t.eq(rows, 5, "--tune: the five fastest configurations")
out, code = run(env .. launcher .. " --plan --world=4 --tune --memory=1KiB recipes/gpt2.lua --preset=tiny")
t.ok(code ~= 0 and out:find("fits --memory=", 1, true) and out:find("over by", 1, true),
  "--tune with nothing that fits: the closest configurations and by how much")
out, code = run(env .. launcher .. " --plan --world=4 --all-ranks" .. job .. " --diverge-rank=3")
t.ok(code ~= 0 and out:find("differs: rank 0 issues .*, rank 3 issues #%d+ all%-reduce%-doubles") ~= nil,
  "--all-ranks names the first diverging collective and the ranks on each side" .. "\n" .. out)
out, code = run(env .. launcher .. " --plan --world=4 --all-ranks" .. job)
t.ok(code == 0 and out:find("the 4 ranks issue the same collectives", 1, true), "--all-ranks: ranks that agree")
-- bad input: one line each
for _, bad in ipairs({ { "--link=fast --ranks-per-node=1", "--link: bad rate 'fast'" },
  { "--memory=lots", "--memory: bad size 'lots'" }, { "--ranks-per-node=3", "--ranks-per-node=3 does not divide --world=4" },
  { "--link=10Gbit", "--link describes the link between nodes" } }) do
  out, code = run(env .. launcher .. " --plan --world=4 " .. bad[1] .. job)
  local lines = select(2, out:gsub("\n", "")) - 1
  t.ok(code ~= 0 and out:find(bad[2], 1, true) and lines == 1, bad[1] .. ": one line naming what is wrong\n" .. out)
end
out, code = run(launcher .. " --memory=1GiB" .. job)
t.ok(code ~= 0 and out:find("only applies with --plan", 1, true), "--memory without --plan")
os.remove(cal_path)

t.done()
