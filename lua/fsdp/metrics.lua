-- fsdp.metrics: per-step training figures, for the log line and a JSON
-- lines file (one object per step; tools/plot draws them).
--
--   local metrics = require "fsdp.metrics"
--   local m = metrics.new { path = "run.jsonl",               -- optional: the JSON lines file
--                           tokens_per_step = B * T * world,   -- the global batch, in tokens
--                           flops_per_token = metrics.gpt_flops_per_token(n_params, n_layer, n_embd, T) }
--   for step = 1, steps do
--     m:begin_step()
--     ... forward, backward, optimizer ...
--     local r = m:end_step { step = step, loss = l, lr = lr, grad_norm = gn }
--     print(m:format(r))
--   end
--   m:record { step = step, eval_loss = el }   -- a line of other figures
--   local s = m:summary()                      -- { steps, mean_step_ms, peak_bytes } so far
--   m:close()
--
-- Every figure is this step's, never a total since the last log line:
-- step ms, tokens/s, MFU, peak memory per tag (and in all), bytes all-gathered and
-- reduced, and the time spent waiting on collectives, each the maximum over
-- ranks (one small all-reduce per step). end_step is collective: every
-- rank calls it; only rank 0 writes the file.
--
-- MFU is model FLOPs per second over a stated peak: opts.peak_flops, else
-- $FSDP_PEAK_TFLOPS, else on a GPU the bf16 dense peak of an H100/H200 SXM
-- (989 TFLOP/s), else on the CPU this machine's f32 matmul rate, measured
-- once (metrics.cpu_peak_flops); on a device that computes nothing (the
-- planner's counting device) none, and no MFU. The peak and where it came from are in
-- m.peak_flops and m.peak_source, and in each record.

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
-- 12 L C T for attention scores and values (the PaLM paper's count).
function M.gpt_flops_per_token(n_params, n_layer, n_embd, T)
  return 6 * n_params + 12 * n_layer * n_embd * T
end

local cpu_peak
--- metrics.cpu_peak_flops() -> FLOP/s of an f32 (512 x 512) @ (512 x 512)
-- matmul on this rank's threads, best of 5 after a warm-up (measured once).
function M.cpu_peak_flops()
  if cpu_peak then return cpu_peak end
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
  cpu_peak = 2 * n * n * n / math.max(best, 1e-9)
  return cpu_peak
end

local Metrics = {}
Metrics.__index = Metrics

local i64 = ffi.new("int64_t[2]")
local dbl = ffi.new("double[1]")

local function comm_stats()
  if C.fsdp_comm_stats(i64, i64 + 1, dbl) ~= 0 then raise() end
  local g, r = tonumber(i64[0]), tonumber(i64[1])
  if C.fsdp_comm_wire_stats(i64, i64 + 1) ~= 0 then raise() end   -- what moved (compressed: fewer bytes)
  return g, r, tonumber(dbl[0]), tonumber(i64[0]), tonumber(i64[1])
end

--- metrics.new(opts) -> a recorder; see the top of this file.
function M.new(opts)
  opts = opts or {}
  local self = setmetatable({ tokens_per_step = opts.tokens_per_step, flops_per_token = opts.flops_per_token,
                              rank = fsdp.rank(), world = fsdp.world(),
                              n_steps = 0, sum_step_ms = 0, peak_total = 0 }, Metrics)
  local env = tonumber(os.getenv("FSDP_PEAK_TFLOPS") or "")
  if opts.peak_flops then
    self.peak_flops, self.peak_source = opts.peak_flops, "given"
  elseif env then
    self.peak_flops, self.peak_source = env * 1e12, "FSDP_PEAK_TFLOPS"
  elseif fsdp.default_device() == "cuda" then
    self.peak_flops, self.peak_source = M.GPU_BF16_PEAK, "GPU bf16 dense peak (H100/H200 SXM)"
  elseif fsdp.default_device() == "cpu" then
    self.peak_flops, self.peak_source = M.cpu_peak_flops() * fsdp.world(), "CPU f32 matmul, measured"
  else   -- a device that computes nothing (the planner's): no MFU
    self.peak_flops, self.peak_source = nil, "no peak on the " .. fsdp.default_device() .. " device"
  end
  if opts.path and self.rank == 0 then
    local f, err = io.open(opts.path, "w")
    if not f then error("fsdp.metrics: cannot write '" .. opts.path .. "': " .. tostring(err), 2) end
    self.file = f
  end
  local box = ffi.new("fsdp_comm *[1]")
  if C.fsdp_comm_world(box) ~= 0 then raise() end
  self.comm = box[0]
  self.vals = ffi.new("double[?]", 7 + #M.TAGS)
  return self
end

--- m:begin_step(): the step's clock, traffic and memory peaks start here.
function Metrics:begin_step()
  memory.reset_peak()
  self.g0, self.r0, self.w0, self.wg0, self.wr0 = comm_stats()
  self.t0 = require("fsdp.timer").now()
end

--- m:end_step{ step =, loss =, lr =, grad_norm =, ... } -> the record (a
-- table; extra fields are kept). Collective: every rank calls it.
function Metrics:end_step(fig)
  if not self.t0 then error("fsdp.metrics: end_step without begin_step", 2) end
  local dt = require("fsdp.timer").now() - self.t0
  local g, r, w, wg, wr = comm_stats()
  local v = self.vals
  v[0], v[1], v[2], v[3] = dt, g - self.g0, r - self.r0, w - self.w0
  for i, tag in ipairs(M.TAGS) do v[3 + i] = memory.stats(tag).peak end
  v[4 + #M.TAGS] = memory.stats().peak
  v[5 + #M.TAGS], v[6 + #M.TAGS] = wg - self.wg0, wr - self.wr0
  if self.world > 1 and C.fsdp_all_reduce_doubles(self.comm, v, 7 + #M.TAGS, 2) ~= 0 then raise() end
  local rec = {}
  for k, x in pairs(fig or {}) do rec[k] = x end
  rec.step_ms = v[0] * 1e3
  rec.gathered_bytes, rec.reduced_bytes, rec.comm_wait_ms = v[1], v[2], v[3] * 1e3
  rec.wire_gathered_bytes, rec.wire_reduced_bytes = v[5 + #M.TAGS], v[6 + #M.TAGS]
  rec.peak_bytes = {}
  for i, tag in ipairs(M.TAGS) do rec.peak_bytes[tag] = v[3 + i] end
  rec.peak_bytes.total = v[4 + #M.TAGS]
  if self.tokens_per_step then
    rec.tokens_per_s = self.tokens_per_step / math.max(v[0], 1e-9)
    if self.flops_per_token and self.peak_flops then
      rec.mfu = rec.tokens_per_s * self.flops_per_token / self.peak_flops
    end
  end
  self.t0 = nil
  self.n_steps, self.sum_step_ms = self.n_steps + 1, self.sum_step_ms + rec.step_ms
  self.peak_total = math.max(self.peak_total, rec.peak_bytes.total)
  self:record(rec)
  return rec
end

--- m:summary() -> { steps, mean_step_ms, peak_bytes }: over every step
-- recorded so far (0 of each before the first), each step's figures being
-- the maximum over ranks.
function Metrics:summary()
  return { steps = self.n_steps, mean_step_ms = self.sum_step_ms / math.max(1, self.n_steps),
           peak_bytes = self.peak_total }
end

--- m:record(t): one JSON line (rank 0), e.g. { step =, eval_loss = }.
function Metrics:record(t)
  if self.file then
    self.file:write(json.encode(t), "\n")
    self.file:flush()
  end
end

local MiB = 2 ^ 20
--- m:format(rec) -> the log line's figures for one step.
function Metrics:format(r)
  local parts = { string.format("step %5d", r.step or 0) }
  if r.loss then parts[#parts + 1] = string.format("loss %.4f", r.loss) end
  if r.lr then parts[#parts + 1] = string.format("lr %.2e", r.lr) end
  if r.grad_norm then parts[#parts + 1] = string.format("grad norm %.3f", r.grad_norm) end
  parts[#parts + 1] = string.format("%.1f ms/step", r.step_ms)
  if r.tokens_per_s then parts[#parts + 1] = string.format("%.0f tokens/s", r.tokens_per_s) end
  if r.mfu then parts[#parts + 1] = string.format("MFU %.1f%%", 100 * r.mfu) end
  parts[#parts + 1] = string.format("gathered %.2f MiB, reduced %.2f MiB, comm wait %.1f ms",
                                    r.gathered_bytes / MiB, r.reduced_bytes / MiB, r.comm_wait_ms)
  local p = r.peak_bytes
  parts[#parts + 1] = string.format("peak MiB param %.1f grad %.1f optim %.1f act %.1f", p.param / MiB,
                                    p.grad / MiB, p.optimizer / MiB, p.activation / MiB)
  return table.concat(parts, " | ")
end

--- m:close(): closes the file.
function Metrics:close()
  if self.file then self.file:close() end
  self.file = nil
end

return M
