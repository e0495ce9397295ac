-- bench_trace.lua: what the timeline costs. A small GPT (many small ops per
-- step, so per-op costs show) trains N steps; prints the median wall and
-- CPU (os.clock: the process, all threads) ms/step after the first 5.
--   fsdp-lua tools/dev/bench_trace.lua [--steps=30]                 (tracing off)
--   fsdp-lua --trace=/tmp/t.json tools/dev/bench_trace.lua [--steps=30]   (on)
-- Compare against a build without the hooks in the same session, runs
-- interleaved (docs/performance.md, "Timeline").
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local timer = require "fsdp.timer"
local opts = ... or {}
local steps = opts.steps or 30
local cfg = { vocab_size = 256, n_layer = 2, n_head = 2, n_embd = 64, block_size = 32 }
local B, T = 4, 32
local model = nn.GPT(cfg)
local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 3 })
local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-3 })
local ids, tg = {}, {}
for b = 1, B do
  ids[b], tg[b] = {}, {}
  for i = 1, T do ids[b][i] = (b * 131 + i * 17) % 256; tg[b][i] = (b * 71 + i * 29) % 256 end
end
local x, y = fsdp.tensor(ids, { dtype = "i64" }), fsdp.tensor(tg, { dtype = "i64" })
local times, cpu = {}, {}
for step = 1, steps do
  local t0, c0 = timer.now(), os.clock()
  local _, loss = model(x, y)
  loss:backward()
  sharded:clip_grad_norm(1.0)
  opt:step()
  sharded:zero_grad()
  loss:item()
  if step > 5 then
    times[#times + 1] = (timer.now() - t0) * 1e3
    cpu[#cpu + 1] = (os.clock() - c0) * 1e3
  end
end
table.sort(times)
table.sort(cpu)
local mid = math.floor((#times + 1) / 2)
print(string.format("median %.3f ms/step wall, %.3f ms/step CPU, over %d steps", times[mid], cpu[mid], #times))
