-- fsdp.attention_qkv: attention from a packed (B, T, 3C) projection, forward
-- and backward, against fsdp.attention on the split heads (f32 on the CPU,
-- the reference), on every device and float dtype at hand. On CUDA in bf16
-- it runs on the tensor cores with bf16 probabilities: the fused flash
-- kernels where they cover the shape (head dim a multiple of 16 up to 128),
-- else, or with FSDP_CUDA_ATTENTION=gemm, the batched GEMMs; elsewhere it
-- unpacks and runs the f32 kernel, which must give the same values as the
-- split. Which kernels run is checked on the counting device.
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"

local function flat(x) return x:float():cpu():contiguous():view(-1):tolist() end

-- max |a - b| / max(max |b|, 1e-30), and the first index beyond tol
local function rel_err(a, b)
  local fa, fb, mb, err = flat(a), flat(b), 0, 0
  for i = 1, #fb do mb = math.max(mb, math.abs(fb[i])) end
  for i = 1, #fb do
    local e = math.abs(fa[i] - fb[i])
    if e ~= e then return math.huge end   -- NaN
    err = math.max(err, e)
  end
  return err / math.max(mb, 1e-30)
end

-- The reference: split, permute, fsdp.attention, permute back, on the CPU in f32.
local function split_attention(qkv, H, causal)
  local s = qkv:shape()
  local B, T, C = s[1], s[2], s[3] / 3
  local D = C / H
  local x = qkv:view(B, T, 3, H, D):permute(3, 1, 4, 2, 5)   -- (3, B, H, T, D)
  local q = x:narrow(1, 1, 1):reshape(B, H, T, D)
  local k = x:narrow(1, 2, 1):reshape(B, H, T, D)
  local v = x:narrow(1, 3, 1):reshape(B, H, T, D)
  return fsdp.attention(q, k, v, { causal = causal }):permute(1, 3, 2, 4):reshape(B, T, C)
end

-- output and qkv gradient under loss = sum(out * w)
local function run(fn, qkv0, w0, dev, dt)
  local qkv = qkv0:to(dev):cast(dt):detach():requires_grad(true)
  local w = w0:to(dev):cast(dt)
  local y = fn(qkv)
  ;(y:float() * w:float()):sum():backward()
  return y, qkv:get_grad()
end

local devices = { "cpu" }
if pcall(function() return fsdp.zeros(1, { device = "cpu" }):cuda() end) then devices[2] = "cuda" end

local shapes = { { 1, 1, 1, 1 }, { 2, 3, 7, 4 }, { 1, 2, 16, 8 }, { 2, 1, 5, 3 }, { 1, 3, 17, 16 }, { 1, 1, 70, 32 } }
for _, sh in ipairs(shapes) do
  local B, H, T, D = sh[1], sh[2], sh[3], sh[4]
  local C = H * D
  local qkv0 = fsdp.randn(B, T, 3 * C, { seed = 11 + T, device = "cpu" })
  local w0 = fsdp.randn(B, T, C, { seed = 12 + T, device = "cpu" })
  for _, causal in ipairs({ true, false }) do
    for _, dev in ipairs(devices) do
      for _, dt in ipairs({ "f32", "bf16" }) do
        -- the reference sees the same (rounded) inputs, in f32 on the CPU
        local q_in, w_in = qkv0:cast(dt):float(), w0:cast(dt):float()
        local y_ref, g_ref = run(function(x) return split_attention(x, H, causal) end, q_in, w_in, "cpu", "f32")
        local y, g = run(function(x) return fsdp.attention_qkv(x, H, { causal = causal }) end, q_in, w_in, dev, dt)
        local tag = string.format(" (%d,%d,%d,%d)%s %s %s", B, H, T, D, causal and " causal" or "", dev, dt)
        t.eq(y:dtype(), dt, "attention_qkv keeps the dtype" .. tag)
        t.eq(table.concat(y:shape(), ","), table.concat({ B, T, C }, ","), "attention_qkv shape" .. tag)
        -- f32: the same kernel on the same values; bf16: output rounded once
        -- (CPU), or bf16 probabilities and dS (CUDA tensor cores)
        local tol = dt == "f32" and 1e-5 or 2e-2
        local ey, eg = rel_err(y, y_ref), rel_err(g, g_ref)
        t.ok(ey <= tol, string.format("attention_qkv out%s: rel err %.3g <= %g", tag, ey, tol))
        t.ok(eg <= tol, string.format("attention_qkv grad%s: rel err %.3g <= %g", tag, eg, tol))
      end
    end
  end
end

-- which kernels a bf16 qkv runs on a device with the CUDA set, by the
-- counting device: flash where it covers the shape unless
-- FSDP_CUDA_ATTENTION=gemm, the GEMM path otherwise
local meta = require "fsdp.meta"
local mimics, why = pcall(meta.mimic, "cuda")
if not mimics then
  -- only a build without the CUDA table may skip these checks
  t.ok(tostring(why):find("CUDA kernel table is not built", 1, true), "mimic cuda fails only without CUDA: " .. tostring(why))
  print("skipped: the kernel choice on the counting device (" .. tostring(why) .. ")")
end
if mimics then
  local want_gemm = os.getenv("FSDP_CUDA_ATTENTION") == "gemm"
  local function entries(B, H, T, D)
    local qkv = fsdp.randn(B, T, 3 * H * D, { seed = 3, device = "meta" }):cast("bf16"):requires_grad(true)
    meta.reset()
    fsdp.attention_qkv(qkv, H, { causal = true }):sum():backward()
    return meta.by_name()
  end
  local e = entries(2, 3, 70, 16)
  local flash = e.attention_flash_forward_bf16.calls == 1 and e.attention_flash_backward_bf16.calls == 1
  local gemm = e.attention_qkv_forward_bf16.calls == 1 and e.attention_qkv_backward_bf16.calls == 1
  t.ok(want_gemm and gemm and e.attention_flash_forward_bf16.calls == 0 or
    not want_gemm and flash and e.attention_qkv_forward_bf16.calls == 0,
    "head dim 16: " .. (want_gemm and "the GEMM path (FSDP_CUDA_ATTENTION=gemm)" or "the flash kernels"))
  if flash then
    -- bytes by hand: B H = 6 heads, T = 70 (two tiles of 64 rows), causal:
    -- query tile 0 walks 64 key rows, tile 1 all 70
    local walked = 64 + 70
    t.eq(e.attention_flash_forward_bf16.bytes_read, 2 * 6 * 16 * (70 + 2 * walked), "flash forward: q, then k, v per tile")
    t.eq(e.attention_flash_forward_bf16.bytes_written, 6 * (2 * 70 * 16 + 4 * 70), "flash forward: out and lse")
    t.eq(e.attention_flash_backward_bf16.bytes_written, 6 * (4 * 70 + 2 * 3 * 70 * 16), "flash backward: drow, dqkv")
    t.eq(e.attention_flash_forward_bf16.flops, 2 * 6 * 70 * 70 * 16, "flash forward: the causal half of 4 B H T^2 D")
    -- the L2 rule (meta_device.c, tools/gpu_model.lua): 6 small heads fit,
    -- so every walked row after a kernel's first read of it comes from L2
    t.eq(e.attention_flash_forward_bf16.bytes_l2, 6 * (walked - 70) * 2 * 2 * 16, "flash forward from L2: k, v re-reads")
    t.eq(e.attention_flash_backward_bf16.bytes_l2, 6 * (walked - 70) * ((2 * 2 * 16 + 2 * 4) + 2 * 2 * 16),
      "flash backward from L2: the dQ kernel's k, v and the dK, dV kernel's q, dO, lse, Drow re-reads")
    t.eq(e.attention_flash_backward_bf16.bytes_read, 6 * (2 * 3 * 70 * 16 + 4 * 70 + walked * 2 * 2 * 16 +
      2 * 2 * 70 * 16 + walked * (2 * 2 * 16 + 2 * 4)), "flash backward: the Drow and dQ kernel (q, dO, O, lse; "
      .. "k, v per tile), the dK, dV kernel (k, v; q, dO, lse, Drow per tile)")
    t.eq(e.attention_flash_backward_bf16.launches, 2, "flash backward: two kernels (Drow rides on the dQ kernel)")
    -- GPT-2's shape (16 x 12 heads, T 1024, head dim 64): the rule holds
    local function walked_rows(T) local n = math.ceil(T / 64) return 32 * n * (n - 1) + T end
    e = entries(16, 12, 1024, 64)
    t.eq(e.attention_flash_forward_bf16.bytes_l2, 192 * (walked_rows(1024) - 1024) * 2 * 2 * 64,
      "GPT-2's shape: the forward's k, v re-reads from L2")
    t.eq(e.attention_flash_backward_bf16.bytes_l2, 192 * (walked_rows(1024) - 1024) * (2 * 2 * 64 + 8 + 2 * 2 * 64),
      "GPT-2's shape: the backward's re-reads from L2")
    -- one head of T 65536: its q, k, v (24 MiB) fit half the L2, with dO,
    -- O, lse and Drow (40.5 MiB) they do not: the forward gets the rule, the
    -- backward counts every read
    e = entries(1, 1, 65536, 64)
    t.eq(e.attention_flash_forward_bf16.bytes_l2, (walked_rows(65536) - 65536) * 2 * 2 * 64,
      "T 65536: the forward's working set fits, its re-reads come from L2")
    t.eq(e.attention_flash_backward_bf16.bytes_l2, 0, "T 65536: the backward's does not, every read from DRAM")
    t.ok(e.attention_flash_backward_bf16.bytes_read > 0, "T 65536: the backward's reads are counted")
  end
  -- a qkv one element into its storage (contiguous, but not at a 16-byte
  -- address, which the flash kernels' vector accesses need): copied first
  local n = 2 * 70 * 48
  local big = fsdp.randn(1 + n, { seed = 4, device = "meta" }):cast("bf16")
  local function copies(x)
    meta.reset()
    fsdp.attention_qkv(x, 1, { causal = true })
    return meta.by_name().copy_strided.calls
  end
  if not want_gemm then
    t.eq(copies(big:narrow(1, 2, n):view(2, 70, 48)) - copies(big:narrow(1, 1, n):view(2, 70, 48)), 1,
      "a qkv off the 16-byte alignment is copied once before the flash kernels")
  end
  e = entries(1, 2, 9, 8)
  t.ok(e.attention_qkv_forward_bf16.calls == 1 and e.attention_flash_forward_bf16.calls == 0,
    "head dim 8 (not covered): the GEMM path")
  meta.mimic("cpu")
end

-- the same off-alignment qkv on the devices at hand: the values of an
-- aligned copy, forward and backward, bit for bit (the same kernels)
for _, dev in ipairs(devices) do
  local B, T, H, D = 2, 21, 1, 16
  local n = B * T * 3 * H * D
  local big = fsdp.randn(1 + n, { seed = 21, device = "cpu" }):to(dev):cast("bf16")
  local w = fsdp.randn(B, T, H * D, { seed = 22, device = "cpu" }):to(dev):cast("bf16")
  local function fwd_bwd(x)
    x = x:detach():requires_grad(true)
    local y = fsdp.attention_qkv(x, H, { causal = true })
    ;(y:float() * w:float()):sum():backward()
    return flat(y), flat(x:get_grad())
  end
  local y1, g1 = fwd_bwd(big:narrow(1, 2, n):view(B, T, 3 * H * D))
  local y2, g2 = fwd_bwd(big:narrow(1, 2, n):view(B, T, 3 * H * D):clone())
  local same = #y1 == #y2 and #g1 == #g2
  for i = 1, #y1 do same = same and y1[i] == y2[i] end
  for i = 1, #g1 do same = same and g1[i] == g2[i] end
  t.ok(same, "attention_qkv on a qkv one element into its storage: the aligned copy's values " .. dev)
end

-- a custom scale is passed through
do
  local qkv = fsdp.randn(1, 4, 6, { seed = 5, device = "cpu" })
  local a = fsdp.attention_qkv(qkv, 1, { scale = 0.3 })
  local x = qkv:view(1, 4, 3, 1, 2):permute(3, 1, 4, 2, 5)
  local b = fsdp.attention(x:narrow(1, 1, 1):reshape(1, 1, 4, 2), x:narrow(1, 2, 1):reshape(1, 1, 4, 2),
    x:narrow(1, 3, 1):reshape(1, 1, 4, 2), { scale = 0.3 }):reshape(1, 4, 2)
  t.ok(rel_err(a, b) <= 1e-6, "attention_qkv scale option")
end

-- bad input names the op and the shapes
t.raises(function() return fsdp.attention_qkv(fsdp.ones(4, 6), 1) end, { "fsdp_attention_qkv", "f32[4,6]", "3-D" },
  "attention_qkv: 2-D qkv")
t.raises(function() return fsdp.attention_qkv(fsdp.ones(1, 2, 12), 3) end,
  { "fsdp_attention_qkv", "f32[1,2,12]", "3 x 3 heads" }, "attention_qkv: width not 3 x heads")
t.raises(function() return fsdp.attention_qkv(fsdp.ones(1, 2, 6), 0) end, { "fsdp_attention_qkv", "n_head is 0" },
  "attention_qkv: no heads")
t.raises(function() return fsdp.attention_qkv(fsdp.ones(1, 2, 6, { dtype = "i32" }), 1) end,
  { "fsdp_attention_qkv", "f32 or bf16" }, "attention_qkv: integer qkv")

t.done()
