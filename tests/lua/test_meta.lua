-- The counting device ("meta"): its counts for a few ops against figures
-- worked out by hand, its memory against the CPU allocator's for the same
-- training step (the same caching allocator, so equal to the byte), the
-- kernel set it mimics, and its errors.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local meta = require "fsdp.meta"

local prev_default = fsdp.default_device()
meta.mimic("cpu")
t.eq(meta.mimicked(), "cpu", "the CPU kernel set by default")

local function counts_of(fn)
  meta.reset()
  fn()
  return meta.by_name()
end

-- ---- counts, by hand ----
do
  local a = fsdp.randn(3, 5, { seed = 1, device = "meta" })
  local b = fsdp.randn(5, 7, { seed = 2, device = "meta" })
  t.eq(a:device(), "meta", "a tensor on the meta device")
  local e = counts_of(function() a:matmul(b) end)
  t.eq(e.matmul_f32.calls, 1, "matmul: one call")
  t.eq(e.matmul_f32.bytes_read, 4 * (3 * 5 + 5 * 7), "matmul: reads a and b (f32)")
  t.eq(e.matmul_f32.bytes_written, 4 * 3 * 7, "matmul: writes c")
  t.eq(e.matmul_f32.flops, 2 * 3 * 7 * 5, "matmul: 2 M N K")
  t.eq(e.matmul_f32.launches, 1, "matmul: one launch")
  t.eq(e.matmul_f32.syncs, 0, "matmul: no host sync")
  -- a batch of 4 against one shared 2-D b: b read once
  local a3 = fsdp.randn(4, 3, 5, { seed = 3, device = "meta" })
  e = counts_of(function() a3:matmul(b) end)
  t.eq(e.matmul_f32.bytes_read, 4 * (4 * 3 * 5 + 5 * 7), "batched matmul: shared b read once")
  t.eq(e.matmul_f32.flops, 2 * 4 * 3 * 7 * 5, "batched matmul FLOPs")

  -- broadcasting add: (4, 6) + (6): the row is read once
  local x = fsdp.randn(4, 6, { seed = 4, device = "meta" })
  local r = fsdp.randn(6, { seed = 5, device = "meta" })
  e = counts_of(function() local _ = x + r end)
  t.eq(e.binary_f32.calls, 1, "add: one call")
  t.eq(e.binary_f32.bytes_read, 4 * (24 + 6), "add: 24 + 6 elements read")
  t.eq(e.binary_f32.bytes_written, 4 * 24, "add: 24 written")
  t.eq(e.binary_f32.flops, 24, "add: one FLOP per output")

  -- layernorm (8, 16) with weight and bias
  local h = fsdp.randn(8, 16, { seed = 6, device = "meta" })
  local w, bias = fsdp.ones(16, { device = "meta" }), fsdp.zeros(16, { device = "meta" })
  e = counts_of(function() h:layernorm(w, bias, 1e-5) end)
  t.eq(e.layernorm_forward_f32.bytes_read, 4 * (8 * 16 + 16 + 16), "layernorm: x, weight, bias")
  t.eq(e.layernorm_forward_f32.bytes_written, 4 * (8 * 16 + 2 * 8), "layernorm: out, mean, rstd")

  -- causal attention, B=2 H=3 T=5 D=4: q k^T and p v over half the pairs
  local q = fsdp.randn(2, 3, 5, 4, { seed = 7, device = "meta" })
  e = counts_of(function() fsdp.attention(q, q, q, { causal = true }) end)
  t.eq(e.attention_forward_f32.flops, 2 * 2 * 3 * 5 * 5 * 4, "causal attention: 2 B H T^2 D")
  t.eq(e.attention_forward_f32.bytes_read, 4 * 3 * 2 * 3 * 5 * 4, "attention: q, k, v")
  t.eq(e.attention_forward_f32.bytes_written, 4 * (2 * 3 * 5 * 4 + 2 * 3 * 5), "attention: out and lse")

  -- a value to the host: one sync, and it reads zero
  local s = x:sum()
  e = counts_of(function() t.eq(s:item(), 0, "item on meta reads 0") end)
  t.eq(e.copy_to_host.syncs, 1, "item: one host sync")
  t.eq(e.copy_to_host.bytes_read, 4, "item: 4 bytes")
  -- a cast: bytes in both dtypes
  e = counts_of(function() x:cast("bf16") end)
  t.eq(e.cast_any.bytes_read, 4 * 24, "cast reads f32")
  t.eq(e.cast_any.bytes_written, 2 * 24, "cast writes bf16")
  -- AdamW over 10 elements: p, g, m, v read; p, m, v written
  local p, g = fsdp.zeros(10, { device = "meta" }), fsdp.zeros(10, { device = "meta" })
  local m1, m2 = fsdp.zeros(10, { device = "meta" }), fsdp.zeros(10, { device = "meta" })
  e = counts_of(function()
    local core = require "fsdp.core"
    if core.C.fsdp_adamw_step(p, g, m1, m2, 1e-3, 0.9, 0.999, 1e-8, 0, 1) ~= 0 then core.raise() end
  end)
  t.eq(e.adamw_f32.bytes_read, 16 * 10, "adamw reads 4 f32 per element")
  t.eq(e.adamw_f32.bytes_written, 12 * 10, "adamw writes 3 f32 per element")
end

-- ---- host memory is never touched ----
do
  local x = fsdp.zeros(4, { device = "meta" })
  t.raises(function() x:data_ptr() end, { "not in host memory" }, "a meta tensor has no host address")
end

-- ---- memory: the same step on the CPU and on the meta device ----
-- GPT tiny, forward + backward + AdamW: every tag's current and peak bytes
-- are the CPU allocator's exactly (same sizes, same caching, same order).
local function step_memory(device)
  fsdp.set_default_device(device)
  fsdp.memory.empty_cache(device)
  local base = fsdp.memory.all(device)
  fsdp.memory.reset_peak(device)
  local cfg = { vocab_size = 64, n_layer = 2, n_head = 2, n_embd = 32, block_size = 16 }
  local model = nn.GPT(cfg):materialize { seed = 1 }
  local opt = optim.AdamW(optim.decay_groups(model:named_parameters(), 0.1), { lr = 1e-3 })
  local x, y = t.token_batch(11, 2, 16, 64)
  for _ = 1, 2 do
    local _, loss = model(x, y)
    loss:backward()
    optim.clip_grad_norm(model:parameters(), 1.0)
    opt:step()
    opt:zero_grad()
  end
  local now = fsdp.memory.all(device)
  local res = {}
  for _, tag in ipairs(fsdp.memory.tags) do
    res[tag] = { peak = now[tag].peak - base[tag].current, current = now[tag].current - base[tag].current,
      reserved = now[tag].reserved - base[tag].reserved }
  end
  model, opt, x, y = nil, nil, nil, nil
  collectgarbage()
  collectgarbage()
  return res
end
local cpu = step_memory("cpu")
meta.reset()
local mem = step_memory("meta")
fsdp.set_default_device(prev_default)
for _, tag in ipairs(fsdp.memory.tags) do
  t.eq(mem[tag].peak, cpu[tag].peak, "GPT tiny step: " .. tag .. " peak, meta = cpu")
  t.eq(mem[tag].current, cpu[tag].current, "GPT tiny step: " .. tag .. " in use after, meta = cpu")
end
t.ok(cpu.activation.peak > 0 and cpu.param.peak > 0 and cpu.optimizer.peak > 0, "the step allocated")
do
  local e = meta.by_name()
  t.eq(e.adamw_f32.calls % 2, 0, "AdamW ran once per step per tensor, twice")
  t.ok(e.matmul_f32.calls > 0 and e.attention_forward_f32.calls == 4 and e.attention_backward_f32.calls == 4,
    "2 steps x 2 layers of attention forward and backward")
end

-- ---- the CUDA kernel set ----
local ok, err = pcall(meta.mimic, "cuda")
if ok then
  t.eq(meta.mimicked(), "cuda", "mimics the CUDA set")
  local e = meta.by_name()
  t.eq(e.matmul_bf16.present, true, "the CUDA set has bf16 matmul")
  -- every CUDA entry has a cost formula (mimic refuses otherwise): bf16
  -- matmul now runs natively, with no casts
  local a = fsdp.randn(8, 16, { seed = 1, device = "meta" }):cast("bf16")
  local b = fsdp.randn(16, 4, { seed = 2, device = "meta" }):cast("bf16")
  e = counts_of(function() a:matmul(b) end)
  t.eq(e.matmul_bf16.calls, 1, "bf16 matmul: the native entry")
  t.eq(e.matmul_bf16.bytes_read, 2 * (8 * 16 + 16 * 4), "bf16 matmul reads bf16")
  t.eq(e.cast_any.calls, 0, "bf16 matmul: no staging casts")
  -- a bf16 weight whose .grad exists: the weight-gradient GEMM adds into it
  -- (beta = 1), no separate add
  local wgt = fsdp.randn(16, 4, { seed = 5, device = "meta" }):cast("bf16"):requires_grad(true)
  local function fwd_bwd() a:matmul(wgt):sum():backward() end
  fwd_bwd()
  e = counts_of(fwd_bwd)
  t.eq(e.axpy_bf16.calls, 0, "weight gradient accumulated by the GEMM: no add")
  t.eq(e.matmul_bf16.calls, 2, "bf16 matmul forward and the weight-gradient GEMM")
  -- a bias and a LayerNorm's weight and bias: summed into their .grad
  local bias = fsdp.randn(4, { seed = 6, device = "meta" }):cast("bf16"):requires_grad(true)
  local lw = fsdp.randn(4, { seed = 7, device = "meta" }):cast("bf16"):requires_grad(true)
  local lb = fsdp.randn(4, { seed = 8, device = "meta" }):cast("bf16"):requires_grad(true)
  local h8 = fsdp.randn(8, 4, { seed = 9, device = "meta" }):cast("bf16")
  local function fb2() (h8 + bias):layernorm(lw, lb, 1e-5):sum():backward() end
  fb2()
  e = counts_of(fb2)
  t.eq(e.axpy_bf16.calls, 0, "bias and norm gradients added where they are kept: no add")
  t.eq(e.sum_dim_acc_bf16.calls, 1, "the bias gradient summed into its .grad")
  t.eq(e.layernorm_backward_acc_bf16.calls, 1, "the norm's gradients added into their .grad")
  -- a bf16 embedding's gradient stays bf16 (ids sorted on the device, each
  -- row's terms summed in f32 and rounded once): the table written while no
  -- .grad exists, then only the rows of the ids added into it; no staging
  -- casts, no f32 table, no separate add. Bytes: the ids, 16-byte keys
  -- (sorted in tiles of 1024, one merge pass per 16 tiles), dout and the
  -- old rows (the ids unseen: every position taken as its own row)
  for _, n in ipairs({ 5, 2000 }) do
    local etab = fsdp.randn(11, 8, { seed = 10, device = "meta" }):cast("bf16"):requires_grad(true)
    local list = {}
    for i = 1, n do list[i] = (i * 7) % 11 end
    local eids = fsdp.tensor(list, { dtype = "i64", device = "meta" })
    local dout = fsdp.randn(n, 8, { seed = 11, device = "meta" }):cast("bf16")
    local function emb_bwd() fsdp.embedding(etab, eids):backward(dout) end
    local passes = n > 1024 and 1 or 0
    local keys = 16 * n * (passes + 1)
    e = counts_of(emb_bwd)
    t.eq(e.embedding_backward_bf16.calls, 1, n .. " ids, no .grad yet: the bf16 table written")
    t.eq(e.embedding_backward_bf16.bytes_read, 8 * n + keys + 2 * 2 * n * 8, n .. " ids: ids, keys, dout, rows read")
    t.eq(e.embedding_backward_bf16.bytes_written, 2 * 11 * 8 + keys + 2 * n * 8,
      n .. " ids: the table's zeros, keys, rows written")
    t.eq(e.embedding_backward_bf16.launches, 3 + passes, n .. " ids: memset, tile sort, merges, accumulation")
    e = counts_of(emb_bwd)
    t.eq(e.embedding_backward_acc_bf16.calls, 1, n .. " ids, a .grad: its rows added to")
    t.eq(e.embedding_backward_acc_bf16.bytes_read, 8 * n + keys + 2 * 2 * n * 8, n .. " ids: acc bytes read")
    t.eq(e.embedding_backward_acc_bf16.bytes_written, keys + 2 * n * 8, n .. " ids: acc bytes written")
    t.eq(e.embedding_backward_acc_bf16.launches, 2 + passes, n .. " ids: tile sort, merges, accumulation")
    t.eq(e.cast_any.calls + e.axpy_bf16.calls + e.embedding_backward_f32.calls, 0,
      n .. " ids: nothing staged through f32, no separate add")
  end
  -- indices host code gave: checked from their host range, no value read
  -- back; the loss mean and count stay on the device (no host sync at all)
  local tbl = fsdp.randn(11, 4, { seed = 3, device = "meta" }):cast("bf16")
  local ids = fsdp.tensor({ 0, 10, 3, 7, 2, 5 }, { 2, 3 }, { dtype = "i64", device = "meta" })
  local logits = fsdp.randn(6, 11, { seed = 4, device = "meta" }):cast("bf16")
  local targets = fsdp.tensor({ 1, 2, 3, 4, 5, 10 }, { dtype = "i64", device = "meta" })
  e = counts_of(function()
    fsdp.embedding(tbl, ids)
    fsdp.cross_entropy(logits, targets)
  end)
  t.eq(e.copy_to_host.calls, 0, "embedding and cross-entropy on host-given indices: nothing read back")
  t.eq(e.cross_entropy_rows_bf16.calls, 1, "cross-entropy: the rows entry (every row counts)")
  t.eq(e.cross_entropy_forward_bf16.calls, 0, "cross-entropy: not the entry that reads the count back")
  local syncs = 0
  for _, x in pairs(e) do syncs = syncs + x.syncs end
  t.eq(syncs, 0, "embedding + cross-entropy: no host sync")
  -- a write into the indices (here a copy) makes their range unknown: read back again
  ids:copy(fsdp.tensor({ 1, 1, 1, 1, 1, 1 }, { 2, 3 }, { dtype = "i64" }))
  e = counts_of(function() fsdp.embedding(tbl, ids) end)
  t.eq(e.copy_to_host.calls, 1, "indices written after they came from the host: checked from a host copy")
  -- ignore_index inside the targets' range: the count comes back from the device
  local with_ignored = fsdp.tensor({ 1, -100, 3, 4, 5, 10 }, { dtype = "i64", device = "meta" })
  e = counts_of(function() fsdp.cross_entropy(logits, with_ignored) end)
  t.eq(e.cross_entropy_forward_bf16.calls, 1, "targets that may hold ignore_index: the counting entry")
  -- the CPU set: natively where the CPU table has bf16 matmul, else staged
  meta.mimic("cpu")
  local native = meta.by_name().matmul_bf16.present
  e = counts_of(function() a:matmul(b) end)
  t.eq(e.matmul_bf16.calls, native and 1 or 0, "CPU set: the bf16 entry exactly when the CPU table has one")
  t.eq(e.cast_any.calls, native and 0 or 3, "CPU set: without the bf16 entry a and b are widened, c narrowed")
else
  t.ok(tostring(err):find("CUDA kernel table is not built", 1, true), "without CUDA, mimic cuda says why: " ..
    tostring(err))
end
t.raises(function() meta.mimic("meta") end, { "fsdp_meta_mimic", "expected cpu (0) or cuda (1)" },
  "mimic of an unknown kernel set")
meta.mimic("cpu")

-- ---- tools/gpu-model over a small GPT ----
local launcher = os.getenv("FSDP_TEST_LAUNCHER")
if launcher then
  local f = io.popen(string.format("FSDP_LUA=%s tools/gpu-model recipes/gpt2.lua --preset=tiny --dtype=bf16 "
    .. "--batch=4 --ctx=64 2>&1; echo \"exit=$?\"", launcher))
  local out = f:read("*a")
  f:close()
  if ok then
    local ms, mfu, gb, ops, syncs = out:match("\npredicted: ([%d.]+) ms/step, MFU ([%d.]+)%%, DRAM ([%d.]+) GB/step, "
      .. "(%d+) GPU ops/step, (%d+) host syncs/step\n")
    t.ok(ms ~= nil, "gpu-model prints the predicted line:\n" .. out)
    local total = out:match("\ntotal +%d+ +[%d.]+ +[%d.]+ +[%d.]+ +(%d+)")
    t.eq(tonumber(total), tonumber(ops), "GPU ops/step is the sum of the families' launches")
    t.ok(tonumber(syncs or 0) >= 1, "at least the loss comes back to the host")
    t.ok(out:find("gemm_bf16", 1, true) ~= nil, "bf16 compute: the bf16 GEMM family")
    t.ok(out:find("exit=0", 1, true) ~= nil, "gpu-model exits 0")
  else
    t.ok(out:find("no CUDA kernel table in this build", 1, true) and out:find("exit=1", 1, true),
      "gpu-model without CUDA says so in one line")
  end
end

-- Zeroing a bf16 tensor on a device is one memset: no f32 staging copy of
-- twice its size (which a Llama's bf16 flat head gradient made: 2 GiB of
-- "other" at 128K vocabulary); another value still stages through f32.
-- (The CUDA kernel set only: a CPU-only build has none to mimic.)
if ok then
  meta.mimic("cuda")
  local x = fsdp.empty({ 1000, 33 }, { dtype = "bf16", device = "meta", tag = "grad" })
  fsdp.memory.reset_peak("meta")
  local other = fsdp.memory.stats("other", "meta").current
  local e = counts_of(function() x:fill(0) end)
  t.eq(e.zero.calls, 1, "fill(0) of bf16 on a device: one memset")
  t.eq(e.zero.bytes_written, 2 * 33000, "the memset writes the bf16 bytes")
  t.eq(e.fill_f32.calls + e.cast_any.calls, 0, "no f32 fill and no converting copy")
  t.eq(fsdp.memory.stats("other", "meta").peak, other, "no staging buffer")
  e = counts_of(function() x:fill(1.5) end)
  t.eq(e.fill_f32.calls, 1, "fill(1.5) still goes through an f32 fill")
  meta.mimic("cpu")
end
t.done()
