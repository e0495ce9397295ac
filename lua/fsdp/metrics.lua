-- fsdp.metrics: per-step training figures, for the log line and a JSON
-- lines file (one object per line; tools/plot draws them).
--
--   local metrics = require "fsdp.metrics"
--   local m = metrics.new { path = "run.jsonl",               -- optional: the JSON lines file
--                           tokens_per_step = B * T * world,   -- the global batch, in tokens
--                           flops_per_token = metrics.gpt_flops_per_token(n_params, n_layer, n_embd, T),
--                           total_steps = 200,                 -- optional: "step 10/200" and an ETA
--                           config = o, run_id = id }          -- optional: the file's first line
--   for step = first, steps do
--     m:begin_step()
--     ... forward, backward, optimizer ...
--     local r = m:end_step { step = step, loss = l, lr = lr, grad_norm = gn }
--     print(m:format(r))
--   end
--   m:record { step = step, eval_loss = el }   -- a line of other figures
--   local s = m:summary()                      -- this run's steps, their mean after warm-up, peaks
--   m:close()
--
-- Every figure is this step's, never a total since the last log line:
-- step ms, tokens/s, MFU, peak memory per tag (and in all), bytes all-gathered and
-- reduced (logical, and as they moved on the wire: wire_gathered_bytes,
-- wire_reduced_bytes, fewer under compression; the log line adds them in
-- brackets where they differ), and the time spent waiting on collectives, each the maximum over
-- ranks (one small all-reduce per step). end_step is collective: every
-- rank calls it; only rank 0 writes the file.
--
-- The file: with opts.config, a first line {"type": "config", run_id,
-- start_time, host, ranks, version, commit, options = {...}}; then one
-- {"type": "step", ...} per step and {"type": "eval", ...} (or "record")
-- for m:record. Every line has "time", the Unix time in seconds.
--
-- MFU, in the log and in the file alike, is a percentage: model FLOPs per
-- second (flops_per_token, e.g. metrics.gpt_flops_per_token) over a stated,
-- fixed peak: opts.peak_flops, else $FSDP_PEAK_TFLOPS (per device), else on
-- a GPU the bf16 dense peak of an H100/H200 SXM (989 TFLOP/s), else on the
-- CPU this machine's f32 matmul rate with this rank's threads, measured once
-- and cached ($XDG_CACHE_HOME/fsdp-lua/cpu_peak.json, metrics.cpu_peak_flops),
-- times the ranks; on a device that computes nothing (the planner's counting
-- device) none, and no MFU. The peak and where it came from are in
-- m.peak_flops and m.peak_source.

local ffi = require "ffi"
local fsdp = require "fsdp"
local json = require "fsdp.json"
local memory = require "fsdp.memory"

local core = require "fsdp.core"
local C, raise = core.C, core.raise

local M = {}

M.GPU_BF16_PEAK = 989e12   -- H100 / H200 SXM, bf16 dense tensor cores
M.TAGS = { "param", "grad", "optimizer", "activation", "comm" }

--- metrics.gpt_flops_per_token(n_params, n_layer, n_embd, T): training
-- FLOPs per token of a GPT, 6 N for the weights (forward and backward) plus
-- 6 L C T for attention scores and values under the causal mask: llm.c's
-- count (Kaplan et al. 2020, sec. 2.1), so MFU figures compare with its
-- published ones; tools/gpu-check uses the same. (The PaLM paper counts
-- 12 L C T, the unmasked square.) M.FLOPS_FORMULA names it for the log.
M.FLOPS_FORMULA = "6N + 6LCT"
function M.gpt_flops_per_token(n_params, n_layer, n_embd, T)
  return 6 * n_params + 6 * n_layer * n_embd * T
end

-- Steps at the start of a run that the summary leaves out (the first
-- allocations, the JIT, the BLAS threads waking up).
M.WARMUP_STEPS = 3
-- Recent steps whose median step time gives the ETA.
M.ETA_WINDOW = 20

--- metrics.cache_dir() -> $XDG_CACHE_HOME/fsdp-lua (~/.cache/fsdp-lua without it).
function M.cache_dir()
  local base = os.getenv("XDG_CACHE_HOME")
  if not base or base == "" then base = (os.getenv("HOME") or ".") .. "/.cache" end
  return base .. "/fsdp-lua"
end

local function hostname()
  local f = io.open("/proc/sys/kernel/hostname", "r")
  local h = f and f:read("*l")
  if f then f:close() end
  return (h and h ~= "") and h or (os.getenv("HOSTNAME") or "unknown")
end
M.hostname = hostname

-- One f32 (512 x 512) @ (512 x 512) matmul rate on this rank's threads,
-- best of 5 after a warm-up.
local function measure_cpu_peak()
  local n = 512
  local a = fsdp.randn(n, n, { seed = 1, device = "cpu" })
  local b = fsdp.randn(n, n, { seed = 2, device = "cpu" })
  local best = math.huge
  local timer = require "fsdp.timer"
  a:matmul(b):free()
  for _ = 1, 5 do
    local t0 = timer.now()
    local c = a:matmul(b)
    local dt = timer.now() - t0
    c:free()
    if dt < best then best = dt end
  end
  -- given back now: left to the collector, these 8 MiB were still held when
  -- the first step began and counted in its activation peak
  a:free()
  b:free()
  return 2 * n * n * n / math.max(best, 1e-9)
end

local cpu_peak
--- metrics.cpu_peak_flops() -> FLOP/s, where from: this host's f32 matmul
-- rate with this rank's thread count, measured the first time and kept in
-- cache_dir()/cpu_peak.json (one entry per host and thread count), so that
-- MFU is against the same peak in every run. Delete the file to measure again.
function M.cpu_peak_flops()
  if cpu_peak then return cpu_peak[1], cpu_peak[2] end
  local json_ = require "fsdp.json"
  local path = M.cache_dir() .. "/cpu_peak.json"
  local key = hostname() .. "/" .. tostring(fsdp.num_threads and fsdp.num_threads() or 0) .. " threads"
  local f = io.open(path, "r")
  local cache = {}
  if f then
    local ok, t = pcall(json_.decode, f:read("*a") or "")
    f:close()
    if ok and type(t) == "table" then cache = t end
  end
  local v = tonumber(cache[key])
  if v and v > 0 and v < math.huge then
    cpu_peak = { v, "CPU f32 matmul, measured once, cached in " .. path }
    return cpu_peak[1], cpu_peak[2]
  end
  v = measure_cpu_peak()
  cache[key] = v
  os.execute("mkdir -p '" .. M.cache_dir():gsub("'", "'\\''") .. "' 2>/dev/null")
  -- written whole, then renamed: ranks measuring at once never read half a file
  local tmp = string.format("%s.%d.tmp", path, fsdp.rank())
  local where = "not cached"
  local ok = pcall(function()   -- created afresh (O_EXCL|O_NOFOLLOW), never through a planted link
    local fio = require "fsdp.io"
    local text = json_.encode(cache) .. "\n"
    local w = fio.open(tmp, "w")
    w:append(text, #text)
    w:close()
    fio.rename(tmp, path)
  end)
  if ok then where = "cached in " .. path else os.remove(tmp) end
  cpu_peak = { v, "CPU f32 matmul, measured now, " .. where }
  return cpu_peak[1], cpu_peak[2]
end

local function wall_time()
  local ffi_ = require "ffi"
  pcall(ffi_.cdef, "typedef struct { long tv_sec; long tv_usec; } fsdp_metrics_timeval; "
    .. "int gettimeofday(fsdp_metrics_timeval *tv, void *tz);")
  local tv = ffi_.new("fsdp_metrics_timeval")
  ffi_.C.gettimeofday(tv, nil)
  return tonumber(tv.tv_sec) + tonumber(tv.tv_usec) * 1e-6
end
M.wall_time = wall_time

--- metrics.build() -> { version =, commit = } of this fsdp-lua (commit nil
-- when it was built outside a git checkout).
function M.build()
  local ok, b = pcall(require, "fsdp.build")
  local commit = ok and type(b) == "table" and b.commit or nil
  if commit == "" then commit = nil end
  return { version = fsdp.version(), commit = commit }
end

local Metrics = {}
Metrics.__index = Metrics

local i64 = ffi.new("int64_t[2]")
local dbl = ffi.new("double[1]")
local dbl2 = ffi.new("double[1]")

local function comm_stats()
  if C.fsdp_comm_stats(i64, i64 + 1, dbl) ~= 0 then raise() end
  local g, r = tonumber(i64[0]), tonumber(i64[1])
  local wait = tonumber(dbl[0])
  if C.fsdp_comm_wire_stats(i64, i64 + 1) ~= 0 then raise() end   -- what moved (compressed: fewer bytes)
  if C.fsdp_comm_busy(dbl) ~= 0 then raise() end                -- the time a collective ran
  local busy = tonumber(dbl[0])
  -- the replica lane's own figures (hybrid_shard on the CPU: its reductions on a comm thread of their own)
  if C.fsdp_comm_lane_stats(C.FSDP_COMM_REPLICA_LANE, dbl, dbl2) ~= 0 then raise() end
  return g, r, wait, tonumber(i64[0]), tonumber(i64[1]), busy, tonumber(dbl[0]), tonumber(dbl2[0])
end

-- A plain copy of a config table for JSON: options by name, sorted
-- (json.encode sorts keys), functions and cdata as their text.
local function plain(t, depth)
  if type(t) ~= "table" then
    if type(t) == "number" or type(t) == "string" or type(t) == "boolean" then return t end
    return tostring(t)
  end
  if (depth or 0) > 4 then return tostring(t) end
  local out = {}
  for k, v in pairs(t) do out[type(k) == "number" and k or tostring(k)] = plain(v, (depth or 0) + 1) end
  return out
end

local function peak_from_env()
  local text = os.getenv("FSDP_PEAK_TFLOPS")
  if text == nil or text == "" then return nil end
  local v = tonumber(text)
  if not v or v ~= v or v <= 0 or v == math.huge then
    error("fsdp.metrics: FSDP_PEAK_TFLOPS must be a positive number of TFLOP/s per device, as 989 (got '"
      .. text .. "')", 0)
  end
  return v * 1e12
end

--- metrics.new(opts) -> a recorder; see the top of this file.
function M.new(opts)
  opts = opts or {}
  local self = setmetatable({ tokens_per_step = opts.tokens_per_step, flops_per_token = opts.flops_per_token,
                              total_steps = opts.total_steps, warmup_steps = opts.warmup_steps or M.WARMUP_STEPS,
                              rank = fsdp.rank(), world = fsdp.world(), recent = {},
                              n_steps = 0, sum_step_ms = 0, timed_steps = 0, timed_ms = 0, timed_tokens = 0,
                              peak_total = 0 }, Metrics)
  local env = peak_from_env()
  local world = fsdp.world()
  if opts.peak_flops then
    self.peak_flops, self.peak_source = opts.peak_flops, "given"
  elseif env then
    self.peak_flops, self.peak_source = env * world, string.format("FSDP_PEAK_TFLOPS=%g per device x %d", env / 1e12,
      world)
  elseif fsdp.default_device() == "cuda" then
    self.peak_flops, self.peak_source = M.GPU_BF16_PEAK * world, string.format(
      "GPU bf16 dense peak (H100/H200 SXM) %g x %d", M.GPU_BF16_PEAK / 1e12, world)
  elseif fsdp.default_device() == "cpu" then
    local per_rank, where = M.cpu_peak_flops()
    self.peak_flops, self.peak_source = per_rank * world, string.format("%s: %.3g TFLOP/s per rank x %d", where,
      per_rank / 1e12, world)
  else   -- a device that computes nothing (the planner's): no MFU
    self.peak_flops, self.peak_source = nil, "no peak on the " .. fsdp.default_device() .. " device"
  end
  if opts.path and self.rank == 0 then
    local ok, f = pcall(require("fsdp.io").open, opts.path, "w")   -- O_EXCL|O_NOFOLLOW
    if not ok then error("fsdp.metrics: cannot write '" .. opts.path .. "': " .. tostring(f), 2) end
    self.file = f
  end
  self.start_time = wall_time()
  if opts.config then
    local b = M.build()
    self:record { type = "config", run_id = opts.run_id, start_time = os.date("!%Y-%m-%dT%H:%M:%SZ",
      math.floor(self.start_time)), host = hostname(), ranks = world, version = b.version, commit = b.commit,
      peak_flops = self.peak_flops, peak_source = self.peak_source, flops_formula = opts.flops_formula,
      options = plain(opts.config) }
  end
  local box = ffi.new("fsdp_comm *[1]")
  if C.fsdp_comm_world(box) ~= 0 then raise() end
  self.comm = box[0]
  self.vals = ffi.new("double[?]", 10 + #M.TAGS)
  return self
end

--- m:begin_step(): the step's clock, traffic and memory peaks start here.
function Metrics:begin_step()
  memory.reset_peak()
  self.g0, self.r0, self.w0, self.wg0, self.wr0, self.b0, self.rb0, self.rw0 = comm_stats()
  self.t0 = require("fsdp.timer").now()
end

local function median(list)
  local s = {}
  for i, x in ipairs(list) do s[i] = x end
  table.sort(s)
  local n = #s
  if n == 0 then return nil end
  if n % 2 == 1 then return s[(n + 1) / 2] end
  return (s[n / 2] + s[n / 2 + 1]) / 2
end
M.median = median

--- m:end_step{ step =, loss =, lr =, grad_norm =, ... } -> the record (a
-- table; extra fields are kept). Collective: every rank calls it.
function Metrics:end_step(fig)
  if not self.t0 then error("fsdp.metrics: end_step without begin_step", 2) end
  local dt = require("fsdp.timer").now() - self.t0
  local g, r, w, wg, wr, b, rb, rw = comm_stats()
  local v = self.vals
  v[0], v[1], v[2], v[3] = dt, g - self.g0, r - self.r0, w - self.w0
  for i, tag in ipairs(M.TAGS) do v[3 + i] = memory.stats(tag).peak end
  v[4 + #M.TAGS] = memory.stats().peak
  v[5 + #M.TAGS], v[6 + #M.TAGS], v[7 + #M.TAGS] = wg - self.wg0, wr - self.wr0, b - self.b0
  v[8 + #M.TAGS], v[9 + #M.TAGS] = rb - self.rb0, rw - self.rw0
  if self.world > 1 and C.fsdp_all_reduce_doubles(self.comm, v, 10 + #M.TAGS, 2) ~= 0 then raise() end
  local rec = { type = "step" }
  for k, x in pairs(fig or {}) do rec[k] = x end
  rec.step_ms = v[0] * 1e3
  rec.gathered_bytes, rec.reduced_bytes, rec.comm_wait_ms = v[1], v[2], v[3] * 1e3
  rec.wire_gathered_bytes, rec.wire_reduced_bytes = v[5 + #M.TAGS], v[6 + #M.TAGS]
  -- busy: a collective ran; exposed: the compute waited for one (comm_wait_ms, the older name)
  rec.comm_busy_ms, rec.comm_exposed_ms = v[7 + #M.TAGS] * 1e3, rec.comm_wait_ms
  if v[8 + #M.TAGS] > 0 then   -- part of the above: the replica lane's collectives and the waits for them
    rec.replica_busy_ms, rec.replica_exposed_ms = v[8 + #M.TAGS] * 1e3, v[9 + #M.TAGS] * 1e3
  end
  rec.peak_bytes = {}
  for i, tag in ipairs(M.TAGS) do rec.peak_bytes[tag] = v[3 + i] end
  rec.peak_bytes.total = v[4 + #M.TAGS]
  if self.tokens_per_step then
    rec.tokens_per_s = self.tokens_per_step / math.max(v[0], 1e-9)
    if self.flops_per_token and self.peak_flops then
      rec.mfu = 100 * rec.tokens_per_s * self.flops_per_token / self.peak_flops   -- percent
    end
  end
  self.t0 = nil
  self.n_steps, self.sum_step_ms = self.n_steps + 1, self.sum_step_ms + rec.step_ms
  self.first_step = self.first_step or rec.step
  self.last_step = rec.step
  if self.n_steps > self.warmup_steps then
    self.timed_steps, self.timed_ms = self.timed_steps + 1, self.timed_ms + rec.step_ms
  end
  local recent = self.recent
  recent[#recent + 1] = rec.step_ms
  if #recent > M.ETA_WINDOW then table.remove(recent, 1) end
  if self.total_steps and type(rec.step) == "number" then
    rec.total_steps = self.total_steps
    rec.eta_s = median(recent) / 1e3 * math.max(0, self.total_steps - rec.step)
  end
  self.peak_total = math.max(self.peak_total, rec.peak_bytes.total)
  self:record(rec)
  return rec
end

--- m:summary() -> { steps, first_step, last_step, warmup_steps,
-- timed_steps, mean_step_ms, tokens_per_s, mfu, peak_bytes }: over the
-- steps this recorder saw (this run's, not a resumed checkpoint's), the
-- mean leaving out the first warmup_steps (M.WARMUP_STEPS) of them unless
-- that would leave none; each step's figures being the maximum over ranks.
function Metrics:summary()
  local warm, n, ms = self.warmup_steps, self.timed_steps, self.timed_ms
  if n == 0 then warm, n, ms = 0, self.n_steps, self.sum_step_ms end
  local mean = ms / math.max(1, n)
  local s = { steps = self.n_steps, first_step = self.first_step, last_step = self.last_step,
              warmup_steps = math.min(warm, self.n_steps), timed_steps = n, mean_step_ms = mean,
              peak_bytes = self.peak_total }
  if self.tokens_per_step and n > 0 then
    s.tokens_per_s = self.tokens_per_step / math.max(mean / 1e3, 1e-12)
    if self.flops_per_token and self.peak_flops then
      s.mfu = 100 * s.tokens_per_s * self.flops_per_token / self.peak_flops
    end
  end
  return s
end

--- m:record(t): one JSON line (rank 0), e.g. { step =, eval_loss = }, with
-- "time" (Unix seconds) and "type" (default "eval" with eval_loss, else "record").
function Metrics:record(t)
  if self.file then
    local rec = {}
    for k, x in pairs(t) do rec[k] = x end
    rec.time = rec.time or math.floor(wall_time() * 1e3 + 0.5) / 1e3
    rec.type = rec.type or (rec.eval_loss ~= nil and "eval" or "record")
    local line = json.encode(rec) .. "\n"
    self.file:append(line, #line)
  end
end

--- metrics.duration(seconds) -> "45s", "12m05s", "3h07m".
function M.duration(s)
  s = math.max(0, math.floor(s + 0.5))
  if s < 60 then return string.format("%ds", s) end
  if s < 3600 then return string.format("%dm%02ds", math.floor(s / 60), s % 60) end
  return string.format("%dh%02dm", math.floor(s / 3600), math.floor(s % 3600 / 60))
end

local MiB = 2 ^ 20
--- m:format(rec) -> the log line's figures for one step.
--- M.format_comm(busy_ms, exposed_ms) -> "comm busy 14.0 ms, exposed 3.1 ms
-- (78% hidden)": how long a collective ran in the step and how much of
-- that the compute waited for (the rest ran behind compute). Each is the
-- maximum over the ranks. A wait also covers the comm thread's start on a
-- loaded host (the collective queued, not yet running), so exposed can pass
-- busy; hidden is then 0%.
function M.format_comm(busy_ms, exposed_ms)
  if not busy_ms then return string.format("comm wait %.1f ms", exposed_ms) end
  local hidden = busy_ms > 0 and math.max(0, math.min(1, 1 - exposed_ms / busy_ms)) or nil
  return string.format("comm busy %.1f ms, exposed %.1f ms%s", busy_ms, exposed_ms,
                       hidden and string.format(" (%.0f%% hidden)", 100 * hidden) or "")
end

function Metrics:format(r)
  local total = r.total_steps
  local parts = { total and string.format("step %" .. #tostring(total) .. "d/%d", r.step or 0, total)
                  or string.format("step %5d", r.step or 0) }
  if r.loss then parts[#parts + 1] = string.format("loss %.4f", r.loss) end
  if r.lr then parts[#parts + 1] = string.format("lr %.2e", r.lr) end
  if r.grad_norm then parts[#parts + 1] = string.format("grad norm %.3f", r.grad_norm) end
  parts[#parts + 1] = string.format("%.1f ms/step", r.step_ms)
  if r.tokens_per_s then parts[#parts + 1] = string.format("%.0f tokens/s", r.tokens_per_s) end
  if r.mfu then parts[#parts + 1] = string.format("MFU %.2f%%", r.mfu) end
  -- compressed traffic: the bytes that moved follow the logical ones ("wire")
  local function wire(logical, w)
    return (w and w ~= logical) and string.format(" (wire %.2f MiB)", w / MiB) or ""
  end
  parts[#parts + 1] = string.format("gathered %.2f MiB%s, reduced %.2f MiB%s",
                                    r.gathered_bytes / MiB, wire(r.gathered_bytes, r.wire_gathered_bytes),
                                    r.reduced_bytes / MiB, wire(r.reduced_bytes, r.wire_reduced_bytes))
  local comm = M.format_comm(r.comm_busy_ms, r.comm_exposed_ms or r.comm_wait_ms)
  if r.replica_busy_ms then
    comm = comm .. string.format(" (replicas: busy %.1f ms, exposed %.1f ms)", r.replica_busy_ms, r.replica_exposed_ms)
  end
  parts[#parts + 1] = comm
  local p = r.peak_bytes
  parts[#parts + 1] = string.format("peak MiB param %.1f grad %.1f optim %.1f act %.1f", p.param / MiB,
                                    p.grad / MiB, p.optimizer / MiB, p.activation / MiB)
  if r.eta_s then parts[#parts + 1] = "ETA " .. M.duration(r.eta_s) end
  return table.concat(parts, " | ")
end

--- m:close(): closes the file.
function Metrics:close()
  if self.file then self.file:close() end
  self.file = nil
end

return M
