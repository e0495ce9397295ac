-- Checks a timeline written by --trace: fsdp-lua check_trace.lua FILE RANKS STEPS [hybrid]
-- One process per rank, the compute/comm/steps tracks, every collective on
-- every rank (the same sequence), positive durations, proper nesting per
-- track, the step boundaries, the op fields. Exits 1 on the first problem.
local json = require "fsdp.json"
local path, ranks, steps, hybrid = arg[1], tonumber(arg[2]), tonumber(arg[3]), arg[4] == "hybrid"
local function fail(msg) io.stderr:write("check_trace: ", msg, "\n"); os.exit(1) end
local f = io.open(path, "rb") or fail("no trace file " .. tostring(path))
local doc = json.decode(f:read("*a"))
f:close()
local events = doc.traceEvents or fail("no traceEvents")

local names, per = {}, {}   -- per[pid][tid] = { events }
for _, e in ipairs(events) do
  if e.ph == "M" and e.name == "thread_name" then names[e.pid .. "/" .. e.tid] = e.args.name end
  if e.ph == "X" then
    per[e.pid] = per[e.pid] or {}
    per[e.pid][e.tid] = per[e.pid][e.tid] or {}
    table.insert(per[e.pid][e.tid], e)
  end
end
local seen = 0
for pid = 0, ranks - 1 do
  if not per[pid] then fail("no events for rank " .. pid) end
  seen = seen + 1
  for tid, want in pairs { [0] = "steps", [1] = "compute", [2] = "comm" } do
    if names[pid .. "/" .. tid] ~= want then fail(string.format("rank %d track %d is not named %s", pid, tid, want)) end
  end
end
for pid in pairs(per) do if pid >= ranks then fail("events for rank " .. pid .. " of " .. ranks) end end

local colls = {}
for pid = 0, ranks - 1 do
  local comm = per[pid][2] or fail("rank " .. pid .. " has no collectives")
  local list = {}
  for _, e in ipairs(comm) do
    if not (e.dur > 0) then fail(string.format("rank %d: collective %s has duration %s", pid, e.name, e.dur)) end
    if not (e.args.bytes and e.args.seq) then fail("collective without bytes or seq: " .. e.name) end
    list[#list + 1] = e.name .. "#" .. e.args.seq .. ":" .. e.args.bytes .. ":" .. tostring(e.args.unit)
  end
  colls[pid] = list
  local kinds = {}
  for _, e in ipairs(comm) do kinds[e.name] = true end
  if ranks > 1 and not (kinds.all_gather and kinds.reduce_scatter) then
    fail("rank " .. pid .. ": no all_gather or no reduce_scatter on the comm track")
  end
  -- the replica lane's track (hybrid_shard on the CPU): all-reduces beside the comm track's collectives
  local replica = per[pid][3] or {}
  if hybrid then
    if names[pid .. "/3"] ~= "replica comm" then fail("rank " .. pid .. ": track 3 is not named replica comm") end
    local reduces = 0
    for _, e in ipairs(replica) do if e.name == "all_reduce" then reduces = reduces + 1 end end
    if reduces < steps then fail(string.format("rank %d: %d all_reduce on the replica comm track, want >= %d", pid,
                                               reduces, steps)) end
  elseif #replica > 0 then
    fail("rank " .. pid .. ": collectives on the replica comm track without hybrid_shard")
  end
  local comm_all = {}
  for _, e in ipairs(comm) do comm_all[#comm_all + 1] = e end
  for _, e in ipairs(replica) do comm_all[#comm_all + 1] = e end
  local st = per[pid][0] or fail("rank " .. pid .. " has no steps")
  if #st ~= steps then fail(string.format("rank %d: %d steps, want %d", pid, #st, steps)) end
  for i, e in ipairs(st) do
    if e.name ~= "step " .. i or not (e.dur > 0) then fail("bad step event " .. e.name) end
  end
  -- each step's comm figures, recomputed from the events that ended in it: busy, the time covered by a
  -- collective (the queue's frees and splits move nothing); exposed, the compute track's waits
  local bookkeeping = { split = true, free = true, cancel = true, group_end = true }
  for i, e in ipairs(st) do
    local a, b = e.ts, e.ts + e.dur
    local spans, exposed = {}, 0
    for _, c in ipairs(comm_all) do
      local t1 = c.ts + c.dur
      if not bookkeeping[c.name] and t1 > a and t1 <= b + 1e-3 then spans[#spans + 1] = { math.max(c.ts, a), t1 } end
    end
    for _, w in ipairs(per[pid][1] or {}) do
      local t1 = w.ts + w.dur
      if w.name == "wait" and t1 > a and t1 <= b + 1e-3 then exposed = exposed + t1 - math.max(w.ts, a) end
    end
    table.sort(spans, function(x, y) return x[1] < y[1] end)
    local busy, edge = 0, a
    for _, sp in ipairs(spans) do
      local t0 = math.max(sp[1], edge)
      if sp[2] > t0 then busy, edge = busy + sp[2] - t0, sp[2] end
    end
    local args = e.args or {}
    if not (args.comm_busy_ms and args.comm_exposed_ms) then fail(string.format("rank %d step %d: no comm figures", pid, i)) end
    if math.abs(args.comm_busy_ms - busy / 1e3) > 0.05 or math.abs(args.comm_exposed_ms - exposed / 1e3) > 0.05 then
      fail(string.format("rank %d step %d: comm busy %.3f exposed %.3f ms, the events give %.3f and %.3f", pid, i,
                         args.comm_busy_ms, args.comm_exposed_ms, busy / 1e3, exposed / 1e3))
    end
    if ranks > 1 and not (args.comm_busy_ms > 0) then fail(string.format("rank %d step %d: no busy time", pid, i)) end
  end
  local ops = {}
  for _, e in ipairs(per[pid][1] or {}) do
    if e.dur < 0 then fail("negative duration " .. e.name) end
    ops[e.name] = true
  end
  for _, want in ipairs { "matmul", "layernorm", "cross_entropy", "matmul backward", "layernorm backward" } do
    if not ops[want] then fail("rank " .. pid .. ": no " .. want .. " on the compute track") end
  end
  if not (ops.attention or ops.attention_qkv) then fail("rank " .. pid .. ": no attention op on the compute track") end
  -- the units' forward and backward spans, once a step each, and the ops inside them carry their unit
  local spans, unitless = {}, 0
  for _, e in ipairs(per[pid][1] or {}) do
    if e.name:match("^forward ") or e.name:match("^backward ") then spans[e.name] = (spans[e.name] or 0) + 1 end
    if e.name == "matmul" and not e.args.unit then unitless = unitless + 1 end
  end
  for _, want in ipairs { "forward root", "backward root", "forward h.0", "backward h.1" } do
    if spans[want] ~= steps then fail(string.format("rank %d: %s %s times, want %d", pid, want, spans[want] or 0, steps)) end
  end
  if unitless > 0 then fail(string.format("rank %d: %d matmuls without a unit", pid, unitless)) end
  if ranks > 1 and not ops.wait then fail("rank " .. pid .. ": no wait on the compute track") end
  -- nesting: on one track, two events are disjoint or one holds the other
  for tid, list in pairs(per[pid]) do
    table.sort(list, function(a, b) return a.ts < b.ts or (a.ts == b.ts and a.dur > b.dur) end)
    local stack = {}
    for _, e in ipairs(list) do
      while #stack > 0 and e.ts >= stack[#stack].ts + stack[#stack].dur - 1e-3 do table.remove(stack) end
      local top = stack[#stack]
      if top and e.ts + e.dur > top.ts + top.dur + 1e-3 then
        fail(string.format("rank %d track %d: %s [%.3f, +%.3f] overlaps %s [%.3f, +%.3f] without nesting", pid, tid,
                           e.name, e.ts, e.dur, top.name, top.ts, top.dur))
      end
      stack[#stack + 1] = e
    end
  end
end
-- every collective on every rank, in the same order
for pid = 1, ranks - 1 do
  if #colls[pid] ~= #colls[0] then fail(string.format("rank %d ran %d collectives, rank 0 %d", pid, #colls[pid], #colls[0])) end
  for i = 1, #colls[0] do
    if colls[pid][i] ~= colls[0][i] then fail("collective " .. i .. " differs: " .. colls[pid][i] .. " vs " .. colls[0][i]) end
  end
end
print(string.format("trace ok: %d ranks, %d collectives each, %d steps", seen, #colls[0], steps))
