-- gpu_model.lua: what a training step of a recipe would cost on one H200,
-- from the counting device (run by tools/gpu-model; see there for usage).
--
-- The recipe runs for real (model, op layer, schedule, optimizer) on the
-- meta device with the CUDA table's kernel set, so the op layer stages
-- dtypes exactly as on a GPU. Its second training step (the first one
-- allocates optimizer state and warms the caching allocator) is priced
-- entry by entry with the roofline below and summed per kernel family.
--
-- The roofline (H200 SXM; figures measured on such machines, or stated):
--   DRAM            4.3 TB/s for every byte a kernel reads or writes in
--                   device memory (a device-to-device copy's rate): the
--                   best case for memory-bound kernels
--   bf16 GEMM       790 TFLOP/s at large sizes (cuBLAS, tensor cores),
--                   scaled by wave quantization: 128 x 128 output tiles
--                   over 132 SMs, so a GEMM of t tiles runs at
--                   t / (132 ceil(t / 132)) of the peak (small GEMMs)
--   f32 GEMM        50 TFLOP/s (SGEMM on the CUDA cores; TF32 off, as the
--                   engine sets cuBLAS by default; 67 TFLOP/s peak)
--   bf16 attention  790 TFLOP/s for its batched GEMMs (B x H of T x T x D)
--   flash attention the fused kernels of attention_flash.cu: 25% of
--                   790 TFLOP/s forward, 20% backward, for the products they
--                   compute (see compute_rate)
--   f32 attention   8 TFLOP/s (the engine's CUDA-core attention kernels:
--                   two shared-memory loads per FMA, 25% occupancy, as
--                   estimated by review)
--   a launch        at least 4 us of GPU time per kernel (launch latency,
--                   ramp-up and tail of a small kernel)
--   a host sync     20 us (the host waits, the GPU's queue runs dry and
--                   refills)
--   host transfers  50 GB/s (PCIe 5 x16, pageable staging)
--   cudaMalloc/Free 50 us each (cudaFree also synchronizes the device)
-- DRAM bytes are the bytes a kernel reads and writes, less the re-reads an
-- L2 rule serves from the 50 MB L2. One rule is applied, and only to the
-- flash attention (engine/meta/meta_device.c, flash_l2_holds, counts the
-- bytes it serves as bytes_l2):
--   a row one kernel's blocks read again and again is read from DRAM once,
--   when every re-read is by blocks of the same (batch, head), those blocks
--   are adjacent in the grid (so they run together), and the rows of all
--   the heads the blocks in flight touch fit in half the L2 (25 MiB; half,
--   because the H200's L2 is two partitions and other traffic shares it)
-- It holds for attention_flash.cu, whose block b takes head b / tiles
-- and re-reads only that head's k, v (forward, dQ) or q, dO, lse, Drow
-- (dK, dV): at GPT-2's shape (T 1024, head dim 64) a head's rows are
-- 384 KiB (forward: q, k, v) and 648 KiB (backward: q, k, v, dO, O, lse,
-- Drow), and the blocks in flight (132 SMs x 3 or 2 blocks, taken twice
-- over for blocks of a head that finish at different times, plus a head
-- either side) touch 52 or 35 heads, 20 or 22 MiB of 25. Nothing else gets
-- an L2 discount (e.g. an operand a GEMM reads per tile, data one kernel
-- leaves for the next). The table's "GB read" is after the rule; "GB L2" is
-- what it served, and the line after "predicted:" gives the DRAM figure
-- counting every read (no L2 reuse at all). A rule, not a measurement:
-- tools/gpu-check measures the flash kernels' DRAM bytes with ncu on a GPU.
-- Each op costs max(DRAM bytes / DRAM, FLOPs / its compute rate, launches x
-- 4 us), plus its syncs. MFU counts the GEMM and attention FLOPs against
-- the 989 TFLOP/s dense bf16 peak.
local fsdp = require "fsdp"
local meta = require "fsdp.meta"
local dryrun = require "fsdp.dryrun"

local H200 = {
  dram = 4.3e12, gemm_bf16 = 790e12, gemm_f32 = 50e12, attention_f32 = 8e12, peak_bf16 = 989e12,
  sms = 132, tile = 128, launch_s = 4e-6, sync_s = 20e-6, host_link = 50e9, malloc_s = 50e-6,
}

-- Compute rate of an entry (FLOP/s), or nil: memory-bound (the DRAM rate).
-- An entry gpuspeed adds needs a line here only when it is compute-bound.
local compute_rate = {
  matmul_bf16 = function() return H200.gemm_bf16 end,
  -- cuBLASLt's GEMMs with a fused epilogue: as matmul_bf16 (the epilogue's
  -- extra bytes and FLOPs are in the counts)
  matmul_epilogue_bf16 = function() return H200.gemm_bf16 end,
  matmul_f32 = function() return H200.gemm_f32 end,
  attention_forward_f32 = function() return H200.attention_f32 end,
  attention_backward_f32 = function() return H200.attention_f32 end,
  -- the packed bf16 attention's batched GEMMs compute every one of the T x T
  -- scores, the counts hold the useful (causal: half) FLOPs: half the GEMM rate
  attention_qkv_forward_bf16 = function() return H200.gemm_bf16 / 2 end,
  attention_qkv_backward_bf16 = function() return H200.gemm_bf16 / 2 end,
  -- the fused flash attention: plain wmma (mma.sync) tiles, the softmax and
  -- the output's rescaling through shared memory, no asynchronous copies or
  -- pipelining, 4 warps a block. FlashAttention-2's hand-tuned kernels reach
  -- 35-50% of the dense peak forward on H100 (about 45-60% of the 790 here)
  -- and less backward; assumed, conservatively, about half of that: 25% of
  -- 790 forward, 20% backward. The counts hold the model's FLOPs (the causal
  -- half, as for the GEMM path); the forward computes those (plus the masked
  -- halves of the diagonal tiles, inside the 25%), the backward 7 products of
  -- T^2 D per 4 counted (scores and dP once in each of its two kernels)
  attention_flash_forward_bf16 = function() return H200.gemm_bf16 * 0.25 end,
  attention_flash_backward_bf16 = function() return H200.gemm_bf16 * 0.20 * 4 / 7 end,
}
-- Entries whose FLOPs count as the model's (for MFU).
local model_flops = { gemm_bf16 = true, gemm_f32 = true, attention = true, attention_bf16 = true }

-- GEMM shape is not in the counts, so the wave quantization is estimated
-- per call from the mean FLOPs of a call: see `gemm_efficiency`.
local function gemm_efficiency(flops_per_call)
  -- a square-ish GEMM of this many FLOPs: M = N = K = (flops / 2)^(1/3)
  local side = (flops_per_call / 2) ^ (1 / 3)
  local tiles = math.ceil(side / H200.tile) ^ 2
  local waves = math.ceil(tiles / H200.sms)
  return tiles / (waves * H200.sms)
end

local function price(e)
  if e.calls == 0 then return 0 end
  if e.family == "memory" then return e.calls * H200.malloc_s end
  local t_sync = e.syncs * H200.sync_s
  if e.family == "transfer" then
    return (e.bytes_read + e.bytes_written) / H200.host_link + e.launches * H200.launch_s + t_sync
  end
  if e.family == "sync" then return t_sync end
  local t_mem = (e.bytes_read - (e.bytes_l2 or 0) + e.bytes_written) / H200.dram
  local t_flop = 0
  local rate = compute_rate[e.name]
  if rate then
    local r = rate()
    if e.name == "matmul_bf16" or e.name == "matmul_epilogue_bf16" then r = r * gemm_efficiency(e.flops / e.calls) end
    t_flop = e.flops / r
  end
  return math.max(t_mem, t_flop, e.launches * H200.launch_s) + t_sync
end

local function usage()
  io.stdout:write([[
tools/gpu-model [recipe] [recipe options]: the predicted cost of one training
step of a recipe on one H200, from the counting device with the CUDA
kernel set. Default: recipes/gpt2.lua --preset=small --dtype=bf16
--batch=16 --ctx=1024 (GPT-2 124M, bf16, batch 16 x 1024).
  --entries   also print every table entry that ran
]])
end

-- the command line arrives parsed (fsdp-lua's recipe arguments): the
-- recipe's path first, our --entries and --help, the rest is the recipe's
local args = ... or {}
-- The planner's time model (fsdp.plan_time) prices its timeline with this
-- same roofline: given { roofline = true }, the file returns it and runs nothing.
if args.roofline then return { device = H200, price = price, model_flops = model_flops } end
if args.help or args.h then usage() return end
local show_entries = args.entries == true
local script = args[1] or "recipes/gpt2.lua"
local rest, shown = {}, {}
for k, v in pairs(args) do
  if k ~= "entries" and k ~= 1 then
    rest[k] = v
    if type(k) == "string" then shown[#shown + 1] = "--" .. k:gsub("_", "-") .. "=" .. tostring(v) end
  end
end
if next(rest) == nil and script == "recipes/gpt2.lua" then
  -- (the whole corpus for evaluation too: held out, it is shorter than one batch)
  rest = { preset = "small", dtype = "bf16", batch = 16, ctx = 1024, val_data = "data/corpus.txt" }
  shown = { "--preset=small", "--dtype=bf16", "--batch=16", "--ctx=1024" }
end
table.sort(shown)

local ok, err = pcall(meta.mimic, "cuda")
if not ok and tostring(err):find("FSDP_CUDA_EPILOGUES", 1, true) then
  io.stdout:write("gpu-model: " .. tostring(err) .. "\n")
  os.exit(1)
elseif not ok then
  io.stdout:write("gpu-model: no CUDA kernel table in this build (nvcc was not found when it was configured), "
    .. "so there is no GPU kernel set to model\n")
  os.exit(1)
end
local chunk, lerr = loadfile(script)
if not chunk then error("gpu-model: " .. tostring(lerr), 0) end

-- the recipe's own log lines stay out of the table
-- (print, io.write and io.stdout:write say nothing while it runs)
local file_methods = getmetatable(io.stdout).__index
local quiet = { print = print, write = io.write, file_write = file_methods.write }
print = function() end
io.write = function() return io.stdout end
file_methods.write = function(f, ...)
  if f == io.stdout then return f end
  return quiet.file_write(f, ...)
end
local r
ok, err = pcall(function()
  r = dryrun.run(chunk, { steps = 2, mimic = "cuda" }, rest)
end)
print, io.write, file_methods.write = quiet.print, quiet.write, quiet.file_write
if not ok then error(err, 0) end
if r.steps_run < 2 then error("gpu-model: " .. script .. " ran fewer than 2 optimizer steps", 0) end

local step = r.steps[2]
local fams = dryrun.by_family(step.kernels)
local total = { calls = 0, br = 0, bw = 0, l2 = 0, flops = 0, mflops = 0, launches = 0, syncs = 0, t = 0 }
local rows = {}
for _, f in ipairs(fams) do
  local t = 0
  for _, e in ipairs(f.entries) do
    e.t = price(e)
    t = t + e.t
  end
  if f.calls > 0 then
    rows[#rows + 1] = { f = f, t = t }
    total.calls = total.calls + f.calls
    total.br, total.bw, total.l2 = total.br + f.bytes_read, total.bw + f.bytes_written, total.l2 + f.bytes_l2
    total.flops = total.flops + f.flops
    if model_flops[f.family] then total.mflops = total.mflops + f.flops end
    total.launches, total.syncs, total.t = total.launches + f.launches, total.syncs + f.syncs, total.t + t
  end
end
table.sort(rows, function(a, b) return a.t > b.t end)

local out = {}
local function say(...) out[#out + 1] = string.format(...) end
say("gpu-model: %s %s on one H200 (counting device, CUDA kernel set), training step 2", script,
  table.concat(shown, " "))
-- GB read: from DRAM, after the L2 rule; GB L2: the re-reads it serves from L2
say("%-28s %8s %10s %10s %10s %9s %6s %10s %8s", "family", "calls", "GB read", "GB written", "GFLOP", "launches",
  "syncs", "ms", "GB L2")
local function row(name, calls, br, bw, fl, launches, syncs, t, l2)
  say("%-28s %8d %10.2f %10.2f %10.1f %9d %6d %10.2f %8.2f", name, calls, (br - l2) / 1e9, bw / 1e9, fl / 1e9,
    launches, syncs, t * 1e3, l2 / 1e9)
end
for _, x in ipairs(rows) do
  local f = x.f
  row(f.family, f.calls, f.bytes_read, f.bytes_written, f.flops, f.launches, f.syncs, x.t, f.bytes_l2)
  if show_entries then
    for _, e in ipairs(f.entries) do
      if e.calls > 0 then row("  " .. e.name, e.calls, e.bytes_read, e.bytes_written, e.flops, e.launches, e.syncs,
        e.t, e.bytes_l2 or 0) end
    end
  end
end
row("total", total.calls, total.br, total.bw, total.flops, total.launches, total.syncs, total.t, total.l2)
local mfu = total.t > 0 and total.mflops / (total.t * H200.peak_bf16) or 0
say("predicted: %.1f ms/step, MFU %.1f%%, DRAM %.1f GB/step, %d GPU ops/step, %d host syncs/step", total.t * 1e3,
  100 * mfu, (total.br - total.l2 + total.bw) / 1e9, total.launches, total.syncs)
-- the same step with every read counted as DRAM traffic (no L2 rule): the
-- upper bound, priced the same way
local t_every = 0
for _, x in ipairs(rows) do
  for _, e in ipairs(x.f.entries) do
    local l2 = e.bytes_l2 or 0
    e.bytes_l2 = 0
    t_every = t_every + price(e)
    e.bytes_l2 = l2
  end
end
say("counting every read as DRAM (no L2 rule): %.1f ms/step, MFU %.1f%%, DRAM %.1f GB/step; the L2 rule serves "
  .. "%.1f GB (tools/gpu_model.lua)", t_every * 1e3, t_every > 0 and 100 * total.mflops / (t_every * H200.peak_bf16) or 0,
  (total.br + total.bw) / 1e9, total.l2 / 1e9)
io.stdout:write(table.concat(out, "\n"), "\n")
