-- A small sharded GPT trained for 4 steps under fsdp.metrics, for
-- tests/sh/test_metrics.sh; checks the per-step records against the
-- planner's traffic per step (fsdp.plan) and the allocator's peaks.
--   fsdp-lua tests/sh/metrics_job.lua OUT.jsonl
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local metrics = require "fsdp.metrics"
local json = require "fsdp.json"
local out = assert(arg[1], "usage: metrics_job.lua OUT.jsonl")
local rank, world = fsdp.rank(), fsdp.world()
local cfg = { vocab_size = 64, n_layer = 2, n_head = 2, n_embd = 32, block_size = 16 }
local B, T, STEPS = 2, 16, 4
local shard_opts = { policy = fsdp.policy.per_block(), seed = 3 }
local plan = require("fsdp.plan").plan(nn.GPT(cfg), shard_opts, world, { rank = rank, batch = B * world, ctx = T })
local model = nn.GPT(cfg)
local sharded = fsdp.shard(model, shard_opts)
local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-3 })
local n_params = model:num_parameters()
local fpt = metrics.gpt_flops_per_token(n_params, cfg.n_layer, cfg.n_embd, T)
local t_start = os.time()
local m = metrics.new { path = out, tokens_per_step = B * T * world, flops_per_token = fpt, total_steps = STEPS + 6,
  config = { steps = STEPS, lr = 1e-3, name = "metrics_job" }, run_id = "run-1" }
t.ok(m.peak_flops > 1e8, "a peak is measured or stated: " .. m.peak_source)
local recs = {}
for step = 1, STEPS do
  local x, y = t.token_batch(step * 31 + rank, B, T, cfg.vocab_size)
  m:begin_step()
  local _, loss = model(x, y)
  loss:backward()
  local norm = sharded:clip_grad_norm(1.0)
  opt:step()
  sharded:zero_grad()
  recs[step] = m:end_step { step = step, loss = loss:item(), lr = 1e-3, grad_norm = norm }
end
-- busy counts only the time a collective runs: a step of compute alone has none, and one where a
-- collective waits 0.3 s for a late rank is busy (and exposed) at least that long
-- (a second, fileless record keeper: the file holds the training steps only)
local function pause(s) local t0 = require("fsdp.timer").now() repeat until require("fsdp.timer").now() - t0 > s end
local m2 = metrics.new {}
m2:begin_step()
pause(0.2)
local idle = m2:end_step { step = 1 }
t.eq(idle.comm_busy_ms, 0, "a step without collectives: no busy time")
t.eq(idle.comm_exposed_ms, 0, "a step without collectives: nothing exposed")
t.ok(idle.step_ms >= 200, "the idle step took its pause: " .. idle.step_ms)
if world > 1 then
  m2:begin_step()
  if rank == 1 then pause(0.3) end
  fsdp.distributed.barrier()
  local late = m2:end_step { step = 2 }
  t.ok(late.comm_busy_ms >= 250, "a collective waiting for a late rank is busy: " .. late.comm_busy_ms)
  t.ok(late.comm_exposed_ms >= 250, "and exposed, the compute waited for it: " .. late.comm_exposed_ms)
end
m:record { step = STEPS, eval_loss = 4.2 }
m:close()

for step, r in ipairs(recs) do
  local what = string.format("rank %d step %d: ", rank, step)
  t.eq(r.gathered_bytes, plan.traffic.gathered_bytes, what .. "gathered bytes are this step's (the planner's figure)")
  t.eq(r.reduced_bytes, plan.traffic.reduced_bytes, what .. "reduced bytes are this step's (the planner's figure)")
  if world > 1 then t.ok(r.gathered_bytes > 0, what .. "something was gathered") end
  t.ok(r.step_ms > 0 and r.comm_wait_ms >= 0 and r.comm_wait_ms <= r.step_ms, what .. "step and wait times")
  -- busy: a collective ran; exposed: the compute waited (each the max over ranks, within the step)
  t.eq(r.comm_exposed_ms, r.comm_wait_ms, what .. "exposed is the wait")
  t.ok(r.comm_busy_ms >= 0 and r.comm_busy_ms <= r.step_ms, what .. "busy within the step: " .. r.comm_busy_ms)
  if world > 1 then t.ok(r.comm_busy_ms > 0, what .. "collectives ran") end
  t.near(r.tokens_per_s, B * T * world / (r.step_ms / 1e3), 1e-9, what .. "tokens/s")
  t.near(r.mfu, 100 * r.tokens_per_s * fpt / m.peak_flops, 1e-9, what .. "MFU, a percentage")
  t.eq(r.total_steps, STEPS + 6, what .. "the run's last step")
  local so_far = {}
  for i = 1, step do so_far[i] = recs[i].step_ms end
  table.sort(so_far)
  local med = #so_far % 2 == 1 and so_far[(#so_far + 1) / 2] or (so_far[#so_far / 2] + so_far[#so_far / 2 + 1]) / 2
  t.near(r.eta_s, med / 1e3 * (STEPS + 6 - step), 1e-9, what .. "the ETA: the median step time x steps left")
  local line = m:format(r)
  t.ok(line:find(string.format("^step +%d/%d |", step, STEPS + 6)) ~= nil, what .. "the line says step N/total: "
    .. line)
  t.ok(line:find(string.format("MFU %.2f%%", r.mfu), 1, true) ~= nil, what .. "the line's MFU is the record's: "
    .. line)
  t.ok(line:find(" | ETA %d+[smh]") ~= nil, what .. "the line's ETA: " .. line)
  t.ok(line:find(string.format("| comm busy %.1f ms, exposed %.1f ms", r.comm_busy_ms, r.comm_exposed_ms), 1, true)
    ~= nil, what .. "the line's comm busy and exposed: " .. line)
  t.ok(r.peak_bytes.param > 0 and r.peak_bytes.optimizer > 0 and r.peak_bytes.activation > 0, what .. "peaks")
  t.ok(m:format(r):find("MFU", 1, true) ~= nil, what .. "log line")
  t.eq(fsdp.distributed.broadcast(r.step_ms, 0), r.step_ms, what .. "every rank logs the same (max over ranks)")
end
-- errors
if rank == 0 then
  t.raises(function() metrics.new { path = "/nonexistent-dir/m.jsonl" } end, { "cannot write", "/nonexistent-dir/m.jsonl" },
           "an unwritable metrics file")
end
t.raises(function() metrics.new {}:end_step {} end, "end_step without begin_step", "end_step first")
-- the file (rank 0): one object per step, then the evaluation
if rank == 0 then
  local lines = {}
  for l in io.lines(out) do lines[#lines + 1] = json.decode(l) end
  t.eq(#lines, 1 + STEPS + 1, "the config line, one line per step, and the eval line")
  local c = lines[1]
  t.eq(c.type, "config", "the first line is the config")
  t.eq(c.run_id, "run-1", "config: the run id")
  t.eq(c.ranks, world, "config: the ranks")
  t.eq(c.options.steps, STEPS, "config: the options")
  t.eq(c.options.name, "metrics_job", "config: the options' strings")
  t.ok(type(c.host) == "string" and c.host ~= "", "config: the host")
  t.ok(c.start_time:match("^%d%d%d%d%-%d%d%-%d%dT%d%d:%d%d:%d%dZ$") ~= nil, "config: the start time " .. c.start_time)
  t.eq(c.version, fsdp.version(), "config: the version")
  t.ok(c.commit == nil or c.commit:match("^%x+$") ~= nil, "config: the commit, when built from a checkout: "
    .. tostring(c.commit))
  t.eq(lines[3].type, "step", "step records")
  t.eq(lines[3].step, 2, "steps in order")
  t.eq(lines[3].gathered_bytes, recs[2].gathered_bytes, "the file holds the records")
  t.near(lines[3].mfu, recs[2].mfu, 1e-9, "the file's MFU is the log's (a percentage)")
  t.eq(lines[STEPS + 2].eval_loss, 4.2, "eval record")
  t.eq(lines[STEPS + 2].type, "eval", "eval record type")
  for i, l in ipairs(lines) do
    -- a minute's slack: the wall clock may be stepped while the job runs (not a monotonic clock, not ms)
    t.ok(type(l.time) == "number" and l.time >= t_start - 60 and l.time <= os.time() + 60,
      "line " .. i .. " has a Unix timestamp: " .. tostring(l.time))
  end
end
t.done()
