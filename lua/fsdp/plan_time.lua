-- fsdp.plan_time: how long a planned step takes. The dry run records, in
-- order, every kernel call of the counting device and every collective's
-- issue and wait (fsdp_timeline_*); this prices each and replays them:
--
--   compute        a kernel call: the CPU's calibrated roofline
--                  (fsdp.calibrate, `fsdp-lua --calibrate`) or, for the
--                  CUDA kernel set, the H200 roofline of tools/gpu_model.lua
--                  (the same model tools/gpu-model prints)
--   communication  alpha-beta per level: a communicator whose members lie
--                  on one node (--ranks-per-node=K) uses the intra-node
--                  figures, one that spans nodes the link's (--link=RATE,
--                  LATENCY), with the bytes the backend puts on the wire:
--                  ring all-gather and all-reduce ((n-1)/n and 2(n-1)/n of
--                  the tensor per rank), the MPI reduce-scatter's pairwise
--                  exchange ((n-1)/n; across nodes a node's ranks share its
--                  link) and its rank-order sum on the comm thread, plus the
--                  agreement before each collective (a small all-reduce)
--   overlap        one comm queue, as the engine's comm thread (or comm
--                  stream): a collective starts when it is issued and the
--                  one before it is done; a wait holds the compute clock
--                  until its collective is done. What the waits held is the
--                  exposed communication.
local ffi = require "ffi"
local core = require "fsdp.core"
local meta = require "fsdp.meta"

local C, raise = core.C, core.raise

local M = {}

local coll_names = { [0] = "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier", "all_reduce_doubles" }

local entries   -- { [index] = { name, family } }, the meta table's order
local function entry_list()
  if not entries then
    entries = {}
    for i, e in ipairs(meta.counts()) do entries[i - 1] = { name = e.name, family = e.family } end
  end
  return entries
end

--- The timeline recorded since fsdp_timeline_record(1): a list of events
-- { type = "kernel", name, family, rd, wr, flops, launches, syncs } |
-- { type = "issue", kind, comm, seq, bytes, size, first, stride, dtype, label (a hash) } |
-- { type = "wait", comm, seq }.
function M.read_timeline()
  local n = ffi.new("int64_t[1]")
  if C.fsdp_timeline_length(n) ~= 0 then raise() end
  local len = tonumber(n[0])
  local F = C.FSDP_TIMELINE_FIELDS
  local buf = ffi.new("int64_t[?]", math.max(1, len * F))
  if C.fsdp_timeline_read(0, len, buf) ~= 0 then raise() end
  local E = entry_list()
  local out = {}
  for i = 0, len - 1 do
    local b = buf + i * F
    local kind = tonumber(b[0])
    if kind == C.FSDP_TIMELINE_KERNEL then
      local e = E[tonumber(b[1])] or { name = "?", family = "?" }
      out[#out + 1] = { type = "kernel", name = e.name, family = e.family, rd = tonumber(b[2]), wr = tonumber(b[3]),
        flops = tonumber(b[4]), launches = tonumber(b[5]), syncs = tonumber(b[6]) }
    elseif kind == C.FSDP_TIMELINE_ISSUE then
      local shape = tonumber(b[5])
      local stride = shape % 65536
      out[#out + 1] = { type = "issue", kind = coll_names[tonumber(b[1])] or "?", comm = tonumber(b[2]),
        seq = tonumber(b[3]), bytes = tonumber(b[4]), size = math.floor(shape / 2 ^ 32),
        first = math.floor(shape / 65536) % 65536, stride = stride == 65535 and -1 or stride, dtype = tonumber(b[6]),
        label = tonumber(b[7]) }
    elseif kind == C.FSDP_TIMELINE_WAIT then
      out[#out + 1] = { type = "wait", comm = tonumber(b[2]), seq = tonumber(b[3]) }
    end
  end
  return out
end

-- ---- compute ----

local roofline   -- tools/gpu_model.lua's, loaded once
local function gpu_roofline()
  if roofline then return roofline end
  local here = debug.getinfo(1, "S").source:match("^@(.*)/lua/fsdp/[^/]*$") or "."
  local path = here .. "/tools/gpu_model.lua"
  local chunk = loadfile(path)
  if not chunk then return nil, "the H200 roofline (tools/gpu_model.lua) is not found next to the library" end
  roofline = chunk({ roofline = true })
  return roofline
end

--- A pricer for one device: function(event) -> seconds, and a description
-- of what it rests on. mimic "cpu" (calibrated rates for `threads`) or
-- "cuda" (the H200 roofline). l2: per entry name, the share of its bytes
-- read that the L2 rule serves (the step's totals, fsdp.meta).
function M.compute_model(mimic, threads, l2)
  if mimic == "cuda" then
    local r, why = gpu_roofline()
    if not r then return nil, why end
    local e = { calls = 1 }
    return function(ev)
      e.name, e.family, e.syncs, e.flops, e.launches = ev.name, ev.family, ev.syncs, ev.flops, ev.launches
      e.bytes_read, e.bytes_written = ev.rd, ev.wr
      e.bytes_l2 = l2 and l2[ev.name] and ev.rd * l2[ev.name] or 0
      return r.price(e)
    end, "one H200, the roofline of tools/gpu_model.lua"
  end
  local cal = require "fsdp.calibrate"
  local r, why = cal.load(threads)
  if not r then return nil, why end
  return function(ev)
    return cal.price_call(r, ev.family, ev.name, ev.rd, ev.wr, ev.flops, ev.launches)
  end, string.format("this machine's calibrated CPU kernels at %d thread%s", r.threads, r.threads == 1 and "" or "s"),
    r
end

-- ---- communication ----

-- Stated figures where nothing is calibrated: NVLink between one node's
-- GPUs (NCCL's usual bus bandwidth on H100/H200 nodes), and a default link.
M.NVLINK = { rate = 360e9, latency = 10e-6 }
M.DEFAULT_LINK = { rate = 100e9 / 8, latency = 20e-6 }
M.CPU_INTRA = { rate = 4e9, latency = 30e-6 }   -- one host's MPI without a calibration of it

local function log2ceil(n)
  local k = 0
  while 2 ^ k < n do k = k + 1 end
  return k
end

--- A pricer of collectives: function(issue event) -> seconds.
-- opts: link = { rate (bytes/s), latency (s) }, ranks_per_node, intra =
-- { rate, latency }, reduce_rate (bytes/s of the MPI reduce-scatter's sum
-- on the comm thread; nil on a GPU).
function M.comm_model(opts)
  local K = opts.ranks_per_node
  local link, intra = opts.link or M.DEFAULT_LINK, opts.intra
  return function(ev)
    local n = ev.size
    if n <= 1 then return 0 end
    -- the nodes the communicator spans, and its ranks on this rank's node
    local nodes, here = {}, nil
    local count = 0
    for i = 0, n - 1 do
      local m = ev.stride > 0 and ev.first + i * ev.stride or i
      local node = math.floor(m / K)
      if not nodes[node] then nodes[node], count = 0, count + 1 end
      nodes[node] = nodes[node] + 1
      here = here or node
    end
    local per_node = nodes[here]
    local b, kind = ev.bytes, ev.kind
    local wire   -- bytes per rank through its own port, and through its node's link
    if kind == "all_gather" or kind == "reduce_scatter" then wire = b * (n - 1) / n
    elseif kind == "all_reduce" then wire = 2 * b * (n - 1) / n
    elseif kind == "broadcast" then wire = b
    else wire = 8 * n end
    local steps = (b >= 65536 and (kind == "all_gather" or kind == "all_reduce")) and (n - 1) or log2ceil(n)
    local agree = 2 * log2ceil(n)
    local t
    if count == 1 then
      t = (steps + agree) * intra.latency + wire / intra.rate
    else
      local over_link
      if kind == "reduce_scatter" then over_link = per_node * b * (n - per_node) / n   -- pairwise, off-node blocks
      else over_link = wire end   -- a ring crosses each node boundary with the whole stream
      t = math.max((steps + agree) * link.latency + over_link / link.rate, wire / intra.rate)
    end
    if kind == "reduce_scatter" and opts.reduce_rate then t = t + b / opts.reduce_rate end
    return t
  end
end

-- ---- the replay ----

--- Replays a timeline: { step, compute, communication, exposed } in seconds
-- (communication: the comm queue's busy time; exposed: the waits).
function M.replay(events, price_kernel, price_comm)
  local t, comm_free, compute, comm, exposed = 0, 0, 0, 0, 0
  local finish = {}
  local calls = 0
  for _, ev in ipairs(events) do
    if ev.type == "kernel" then
      local dt = price_kernel(ev)
      t, compute = t + dt, compute + dt
    elseif ev.type == "issue" then
      local d = price_comm(ev)
      local start = math.max(t, comm_free)
      comm_free = start + d
      comm = comm + d
      finish[ev.comm * 2 ^ 20 + ev.seq] = comm_free
      calls = calls + 1
    else
      local f = finish[ev.comm * 2 ^ 20 + ev.seq]
      if f and f > t then exposed, t = exposed + f - t, f end
    end
  end
  return { step = t, compute = compute, communication = comm, exposed = exposed, collectives = calls }
end

local function cores()
  local f = io.popen("nproc 2>/dev/null")
  local n = f and tonumber(f:read("*l") or "")
  if f then f:close() end
  return n or 1
end

--- The predicted step of plan p (fsdp.plan.run's), or nil and why not.
-- o: link = { rate, latency } across nodes, ranks_per_node (default: every
-- rank on one node), threads (CPU threads per rank; default
-- FSDP_NUM_THREADS, else this host's cores over its ranks). Returns
-- { step, compute, communication, exposed (seconds), collectives,
-- assumptions = { lines } }.
function M.predict(p, o)
  o = o or {}
  if not p.timeline then return nil, "the plan holds no timeline" end
  local K = o.ranks_per_node or p.world
  local on_host = math.min(K, p.world)
  local threads = o.threads or tonumber(os.getenv("FSDP_NUM_THREADS") or "") or
    math.max(1, math.floor(cores() / on_host))
  local price_kernel, what, rates = M.compute_model(p.mimic, threads, p.l2)
  if not price_kernel then return nil, what end
  local intra, intra_what
  if p.mimic == "cuda" then
    intra, intra_what = M.NVLINK, "NVLink between a node's GPUs (stated)"
  else
    local _, _, measured = require("fsdp.calibrate").load(threads)
    if measured then
      intra, intra_what = measured, string.format("one host's MPI as calibrated over %d ranks", measured.ranks)
    else
      intra, intra_what = M.CPU_INTRA, "one host's MPI at a default (run mpirun -np 2 fsdp-lua --calibrate)"
    end
  end
  local link = o.link or M.DEFAULT_LINK
  local price_comm = M.comm_model { link = link, ranks_per_node = K, intra = intra,
    reduce_rate = p.mimic ~= "cuda" and rates and rates.rates.elementwise or nil }
  local r = M.replay(p.timeline, price_kernel, price_comm)
  r.assumptions = {
    "compute: " .. what,
    string.format("inside a node (%d rank%s): %s, %.1f us, %.2f GB/s", K, K == 1 and "" or "s", intra_what,
      intra.latency * 1e6, intra.rate / 1e9),
  }
  if p.world > K then
    r.assumptions[#r.assumptions + 1] = string.format("across nodes: %.2f Gbit/s, %.1f us%s", link.rate * 8 / 1e9,
      link.latency * 1e6, o.link and "" or " (a default: --link=RATE,LATENCY)")
  end
  r.threads, r.ranks_per_node = threads, K
  return r
end

--- "100Gbit", "25Gbit/s", "12.5GB/s", "400Mbit" [, "5us" | "0.2ms" | "20"
-- (us)] -> { rate = bytes/s, latency = s }, or nil and what is wrong.
function M.parse_link(text)
  if type(text) ~= "string" then return nil, "expected RATE[,LATENCY]" end
  local rate_s, lat_s = text:match("^([^,]+),(.+)$")
  rate_s = rate_s or text
  local num, unit = rate_s:match("^%s*([%d.]+[eE]?[%d]*)%s*([%a/]*)%s*$")
  local v = tonumber(num or "")
  local units = { gbit = 1e9 / 8, ["gbit/s"] = 1e9 / 8, gbps = 1e9 / 8, mbit = 1e6 / 8, ["mbit/s"] = 1e6 / 8,
    mbps = 1e6 / 8, tbit = 1e12 / 8, ["tbit/s"] = 1e12 / 8, ["gb/s"] = 1e9, ["mb/s"] = 1e6, gbyte = 1e9 }
  local scale = units[(unit or ""):lower()]
  if not v or v <= 0 or not scale then
    return nil, string.format("bad rate '%s' (a number and a unit: 100Gbit, 25Gbit/s, 400Mbit, 12.5GB/s)", rate_s)
  end
  local latency = M.DEFAULT_LINK.latency
  if lat_s then
    local ln, lu = lat_s:match("^%s*([%d.]+)%s*(%a*)%s*$")
    local lv = tonumber(ln or "")
    local lscale = ({ [""] = 1e-6, us = 1e-6, ms = 1e-3, s = 1, ns = 1e-9 })[(lu or ""):lower()]
    if not lv or not lscale then
      return nil, string.format("bad latency '%s' (as 20us, 0.5ms)", lat_s)
    end
    latency = lv * lscale
  end
  return { rate = v * scale, latency = latency }
end

--- "80GiB", "512MiB", "1.5TB", "4096" (bytes) -> bytes, or nil and what is wrong.
function M.parse_size(text)
  local num, unit = tostring(text):match("^%s*([%d.]+)%s*(%a*)%s*$")
  local v = tonumber(num or "")
  local scale = ({ [""] = 1, b = 1, kib = 2 ^ 10, mib = 2 ^ 20, gib = 2 ^ 30, tib = 2 ^ 40, kb = 1e3, mb = 1e6,
    gb = 1e9, tb = 1e12, k = 2 ^ 10, m = 2 ^ 20, g = 2 ^ 30 })[(unit or ""):lower()]
  if not v or v <= 0 or not scale then
    return nil, string.format("bad size '%s' (a number and a unit: 80GiB, 512MiB, 1.5TB)", tostring(text))
  end
  return math.floor(v * scale)
end

--- The prediction as the plan's line.
function M.format(r)
  local L = { string.format("predicted step: %.2f ms (compute %.2f, communication %.2f, exposed %.2f)",
    r.step * 1e3, r.compute * 1e3, r.communication * 1e3, r.exposed * 1e3) }
  for _, a in ipairs(r.assumptions) do L[#L + 1] = "  " .. a end
  return table.concat(L, "\n")
end

return M
