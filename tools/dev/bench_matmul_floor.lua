-- bench_matmul_floor.lua: the matmuls of one GPT-2 small training step
-- (the 12 blocks' linear layers and the tied head: forward, the input's
-- gradient and the weight's, f32) at a given number of rows, so that the
-- FSDP pair's floor can be measured on its own: 2 ranks x 1 thread each
-- multiply half the rows, at the same time, on a core each; 1 rank x 2
-- threads multiplies all of them. Prints the median ms over reps (after
-- a warm-up, the slowest rank's), GFLOP/s per rank, and the CPU ms per
-- step of all ranks together (os.clock: every thread of a process), which
-- a loaded host moves less than the wall time.
--   FSDP_NUM_THREADS=2 fsdp-lua tools/dev/bench_matmul_floor.lua --rows=256
--   FSDP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 mpirun -np 2 fsdp-lua tools/dev/bench_matmul_floor.lua --rows=128
-- (ranks start each rep together, after a barrier). Batch 4 x 64 is 256 rows.
local fsdp = require "fsdp"
local timer = require "fsdp.timer"
local dist = fsdp.distributed
local opts = ... or {}
local M, reps = opts.rows or 256, opts.reps or 7
local C, V = 768, 50304
-- (K, N) of each linear layer x @ W, W (K, N): qkv, attention out, MLP up, MLP down; then the head
local layers = {}
for _ = 1, 12 do
  layers[#layers + 1] = { C, 3 * C }
  layers[#layers + 1] = { C, C }
  layers[#layers + 1] = { C, 4 * C }
  layers[#layers + 1] = { 4 * C, C }
end
layers[#layers + 1] = { C, V }
local ws, xs, gs, flops = {}, {}, {}, 0
for i, l in ipairs(layers) do
  ws[i] = fsdp.randn(l[1], l[2], { seed = i, std = 0.02 })
  xs[i] = fsdp.randn(M, l[1], { seed = 100 + i })
  gs[i] = fsdp.randn(M, l[2], { seed = 200 + i })
  flops = flops + 3 * 2 * M * l[1] * l[2]
end
local function step()
  for i = 1, #layers do
    local y = fsdp.matmul(xs[i], ws[i])                  -- forward (M, N)
    local dx = fsdp.matmul(gs[i], ws[i], { tb = true })  -- dX (M, K) = dY W^T
    local dw = fsdp.matmul(xs[i], gs[i], { ta = true })  -- dW (K, N) = X^T dY
    y, dx, dw = nil, nil, nil
  end
  fsdp.collect()
end
local times, cpu = {}, {}
fsdp.no_grad(function()
  step()
  for r = 1, reps do
    dist.barrier()
    local t0, c0 = timer.now(), os.clock()
    step()
    times[r], cpu[r] = (timer.now() - t0) * 1e3, (os.clock() - c0) * 1e3
  end
end)
table.sort(times)
table.sort(cpu)
local mid = math.floor((reps + 1) / 2)
local worst, cpu_all = dist.max(times[mid]), dist.sum(cpu[mid])
dist.print0(string.format("matmul floor: %d rank(s), %d rows each: %.1f ms per step (median of %d, max over ranks), "
  .. "%.1f GFLOP/s per rank, %.1f CPU ms per step (all ranks)", dist.world(), M, worst, reps, flops / worst / 1e6,
  cpu_all))
