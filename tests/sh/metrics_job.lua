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
local m = metrics.new { path = out, tokens_per_step = B * T * world, flops_per_token = fpt }
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
m:record { step = STEPS, eval_loss = 4.2 }
m:close()

for step, r in ipairs(recs) do
  local what = string.format("rank %d step %d: ", rank, step)
  t.eq(r.gathered_bytes, plan.traffic.gathered_bytes, what .. "gathered bytes are this step's (the planner's figure)")
  t.eq(r.reduced_bytes, plan.traffic.reduced_bytes, what .. "reduced bytes are this step's (the planner's figure)")
  if world > 1 then t.ok(r.gathered_bytes > 0, what .. "something was gathered") end
  t.ok(r.step_ms > 0 and r.comm_wait_ms >= 0 and r.comm_wait_ms <= r.step_ms, what .. "step and wait times")
  t.near(r.tokens_per_s, B * T * world / (r.step_ms / 1e3), 1e-9, what .. "tokens/s")
  t.near(r.mfu, r.tokens_per_s * fpt / m.peak_flops, 1e-9, what .. "MFU")
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
  t.eq(#lines, STEPS + 1, "one line per step, and the eval line")
  t.eq(lines[2].step, 2, "steps in order")
  t.eq(lines[2].gathered_bytes, recs[2].gathered_bytes, "the file holds the records")
  t.eq(lines[STEPS + 1].eval_loss, 4.2, "eval record")
end
t.done()
