-- Devices: t:to(device), t:cuda(), t:cpu(), the default device, and reading
-- (printing, tolist, item, at) tensors that live on another device.
-- On a machine without a GPU (or an engine without CUDA) only the CPU half
-- runs, plus the checks that asking for CUDA fails with a clear message; with
-- a GPU, round trips must be bitwise exact and ops on CUDA must match the
-- same ops on the CPU.
package.path = (arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local C = require("fsdp.core").C   -- the binding, for the engine calls tested directly
local ffi = require "ffi"

-- ---- the default device ----
local default = fsdp.default_device()
t.ok(default == "cpu" or default == "cuda", "default_device is cpu or cuda")
t.eq(fsdp.zeros(2):device(), default, "constructors use the default device")
t.eq(fsdp.tensor({ 1, 2 }):device(), default, "fsdp.tensor uses the default device")
t.eq(fsdp.zeros(2, { device = "cpu" }):device(), "cpu", "opts.device wins")
t.raises(function() fsdp.set_default_device("tpu") end, "unknown device", "set_default_device: unknown name")
t.raises(function() fsdp.zeros(2, { device = "metal" }) end, "unknown device", "unknown device in opts")

-- Is there a GPU (CUDA built in and a device present)? fsdp_device_info says
-- so when the engine has it; t:cuda() must work exactly then.
local has_cuda = pcall(function() return fsdp.zeros(1, { device = "cpu" }):cuda() end)
if pcall(function() return C.fsdp_device_info end) then
  local avail, desc = ffi.new("int[1]"), ffi.new("char[256]")
  if t.eq(C.fsdp_device_info(1, avail, desc, 256), 0, "fsdp_device_info(cuda)") then
    t.eq(avail[0] == 1, has_cuda, "cuda() works exactly when fsdp_device_info says so (" .. ffi.string(desc) .. ")")
  end
end

-- ---- t:to("cpu") on the CPU: a copy ----
local a = fsdp.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { device = "cpu" })
local b = a:to("cpu")
t.eq(b:device(), "cpu", "to(cpu): on the cpu")
t.all_near(b:tolist(), a:tolist(), 0, "to(cpu): same values")
t.ok(ffi.cast("uintptr_t", b:data_ptr()) ~= ffi.cast("uintptr_t", a:data_ptr()), "to(cpu): distinct storage")
b:fill(0)
t.all_near(a:tolist(), { { 1, 2, 3 }, { 4, 5, 6 } }, 0, "to(cpu): writing the copy leaves the source alone")
local c = a:cpu()
t.all_near(c:tolist(), a:tolist(), 0, "cpu(): same values")
t.ok(ffi.cast("uintptr_t", c:data_ptr()) ~= ffi.cast("uintptr_t", a:data_ptr()), "cpu(): distinct storage")

-- a transposed view comes back contiguous, values in its own order
local at = a:t():to("cpu")
t.ok(at:is_contiguous(), "to(cpu) of a view: contiguous")
t.all_near(at:tolist(), { { 1, 4 }, { 2, 5 }, { 3, 6 } }, 0, "to(cpu) of a view: values")
-- every dtype, and the memory tag, survive
for _, dt in ipairs({ "f32", "bf16", "i32", "i64", "u16" }) do
  local x = fsdp.tensor({ 1, 2, 3 }, { dtype = dt, device = "cpu", tag = "param" })
  local y = x:to("cpu")
  t.eq(y:dtype(), dt, "to(cpu) keeps dtype " .. dt)
  t.eq(y:tag(), "param", "to(cpu) keeps the tag (" .. dt .. ")")
  t.all_near(y:tolist(), { 1, 2, 3 }, 0, "to(cpu) values " .. dt)
end
t.eq(fsdp.zeros(0, { device = "cpu" }):to("cpu"):numel(), 0, "to(cpu) of an empty tensor")
t.eq(fsdp.tensor(2.5, { device = "cpu" }):to("cpu"):item(), 2.5, "to(cpu) of a 0-D tensor")
-- not recorded: the copy is a fresh leaf
local g = fsdp.tensor({ 1, 2 }, { device = "cpu", requires_grad = true })
t.eq(g:to("cpu"):requires_grad(), false, "to(): no gradient")
t.raises(function() a:to() end, "expected a device", "to() without a device")
t.raises(function() a:to("gpu") end, "unknown device", "to(): unknown device name")
-- a t:clone() stays on its tensor's device
t.eq(a:clone():device(), "cpu", "clone keeps the device")

if not has_cuda then
  -- ---- no GPU: CUDA is refused, clearly ----
  t.eq(default, "cpu", "no GPU: the default device is the cpu")
  t.raises(function() return a:cuda() end,
           { "fsdp_tensor_to_device", "cuda is not built into this engine, or has no hardware" },
           "cuda() without a GPU names the device")
  t.raises(function() return a:to("cuda") end, { "cuda", "not built into this engine, or has no hardware" },
           "to(cuda) without a GPU")
  t.raises(function() fsdp.set_default_device("cuda") end,
           { "cuda", "not built into this engine, or has no hardware" }, "set_default_device(cuda) without a GPU")
  t.eq(fsdp.default_device(), "cpu", "the default device stays the cpu after a refused change")
  t.raises(function() fsdp.zeros(2, { device = "cuda" }) end, { "cuda", "not built into this engine" },
           "zeros on cuda without a GPU")
  print("no GPU: CUDA checks skipped")
  t.done()
  return
end

-- ---- with a GPU ----
print("GPU present: running the CUDA checks")
local function bits_equal(x, y)
  -- bitwise: compare the raw bytes on the host
  local n = x:numel() * ({ f32 = 4, bf16 = 2, i32 = 4, i64 = 8, u16 = 2 })[x:dtype()]
  if y:numel() ~= x:numel() or y:dtype() ~= x:dtype() then return false end
  local xb, yb = ffi.new("uint8_t[?]", n + 1), ffi.new("uint8_t[?]", n + 1)
  if C.fsdp_tensor_to_data(x, xb, n) ~= 0 or C.fsdp_tensor_to_data(y, yb, n) ~= 0 then return false end
  return ffi.string(xb, n) == ffi.string(yb, n)
end

for _, dt in ipairs({ "f32", "bf16", "i32", "i64", "u16" }) do
  local x
  if dt == "f32" or dt == "bf16" then
    x = fsdp.randn(37, 53, { seed = 3, dtype = dt, device = "cpu" })
  else
    x = fsdp.arange(0, 37 * 53, { dtype = dt, device = "cpu" }):reshape(37, 53)
  end
  local xc = x:cuda()
  t.eq(xc:device(), "cuda", "cuda(): on the GPU (" .. dt .. ")")
  local back = xc:cpu()
  t.eq(back:device(), "cpu", "cpu(): back on the host (" .. dt .. ")")
  t.ok(bits_equal(back, x), "cpu -> cuda -> cpu is bitwise exact (" .. dt .. ")")
  t.ok(bits_equal(xc:to("cuda"):cpu(), x), "cuda -> cuda copy is bitwise exact (" .. dt .. ")")
  t.ok(bits_equal(xc:t():cpu(), x:t():contiguous()), "a transposed CUDA view comes back in its order (" .. dt .. ")")
end

-- reading CUDA tensors goes through the host
local m = fsdp.tensor({ { 1, 2 }, { 3, 4 } }, { device = "cpu" }):cuda()
t.all_near(m:tolist(), { { 1, 2 }, { 3, 4 } }, 0, "tolist of a CUDA tensor")
t.eq(m:at(2, 1), 3, "at of a CUDA tensor")
t.eq(m:sum():item(), 10, "item of a CUDA tensor")
t.ok(tostring(m):find("on cuda", 1, true) ~= nil, "printing a CUDA tensor")
t.raises(function() return m:data_ptr() end, "not in host memory", "data_ptr refuses device memory")
t.raises(function() return m + fsdp.ones(2, 2, { device = "cpu" }) end, { "cuda", "cpu" }, "mixing devices names both")
-- the optimizer steps read every tensor with one kernel: one device for all
do
  local p, g = fsdp.ones(5, { device = "cpu" }), fsdp.ones(5, { device = "cuda" })
  local m1, m2 = fsdp.zeros(5, { device = "cpu" }), fsdp.zeros(5, { device = "cpu" })
  local function adamw(grad, a) return C.fsdp_adamw_step(p, grad, a, m2, 0.1, 0.9, 0.99, 1e-8, 0, 1) end
  t.eq(adamw(g, m1), C.FSDP_ERR_DEVICE, "adamw: a gradient on another device is refused")
  local msg = ffi.string(C.fsdp_last_error())
  t.ok(msg:find("fsdp_adamw_step: grad f32%[5%] cuda and param f32%[5%] cpu are on different devices") ~= nil,
       "adamw device error names both: " .. msg)
  t.eq(adamw(p * 0 + 1, fsdp.zeros(5, { device = "cuda" })), C.FSDP_ERR_DEVICE, "adamw: state on another device")
  t.all_near(p:tolist(), { 1, 1, 1, 1, 1 }, 0, "refused steps leave the parameter as it was")
  t.eq(C.fsdp_axpy_(p, g, 1), C.FSDP_ERR_DEVICE, "axpy across devices is refused")
end

-- ops on CUDA equal the same ops on the CPU (f32, within reassociation)
local x = fsdp.randn(8, 16, { seed = 11, device = "cpu" })
local w = fsdp.randn(16, 12, { seed = 12, device = "cpu" })
local xc, wc = x:cuda(), w:cuda()
local function same(cpu_result, cuda_result, tol, name)
  t.eq(cuda_result:device(), "cuda", name .. ": result on cuda")
  t.all_near(cuda_result:cpu():tolist(), cpu_result:tolist(), tol, name)
end
same(x + x, xc + xc, 1e-6, "add")
same(x * 3 - 1, xc * 3 - 1, 1e-6, "scale, add_scalar")
same(x:matmul(w), xc:matmul(wc), 1e-4, "matmul")
same(x:gelu(), xc:gelu(), 1e-5, "gelu")
same(x:softmax(), xc:softmax(), 1e-5, "softmax")
same(x:sum(2), xc:sum(2), 1e-5, "sum over a dim")
same(x:layernorm(nil, nil, 1e-5), xc:layernorm(nil, nil, 1e-5), 1e-4, "layernorm")
same(x:bf16():float(), xc:bf16():float(), 0, "cast to bf16 and back")

-- bf16 matmul: the CPU stages it through f32, CUDA multiplies bf16 on the
-- tensor cores with f32 accumulation; both round once to bf16, so they agree
-- within a bf16 rounding (|values| here stay below 16: 2^-8 * 16 = 0.0625),
-- forward and backward, plain and batched, transposed operands too
do
  local function grads(dev, ta, tb)
    local a = (ta and x:transpose(1, 2) or x):bf16():to(dev):contiguous():detach():requires_grad(true)
    local b = (tb and w:transpose(1, 2) or w):bf16():to(dev):contiguous():detach():requires_grad(true)
    local a_op, b_op = ta and a:transpose(1, 2) or a, tb and b:transpose(1, 2) or b
    local y = a_op:matmul(b_op)
    local loss = (y:float() * y:float()):sum()
    loss:backward()
    return y, a:get_grad(), b:get_grad()
  end
  for _, tr in ipairs({ { false, false }, { true, false }, { false, true } }) do
    local yc, gac, gbc = grads("cpu", tr[1], tr[2])
    local yg, gag, gbg = grads("cuda", tr[1], tr[2])
    local tag = string.format(" (bf16, trans %s %s)", tostring(tr[1]), tostring(tr[2]))
    t.eq(yg:dtype(), "bf16", "matmul result stays bf16" .. tag)
    same(yc:float(), yg:float(), 0.0625, "matmul" .. tag)
    same(gac:float(), gag:float(), 0.5, "matmul grad a" .. tag)
    same(gbc:float(), gbg:float(), 0.5, "matmul grad b" .. tag)
  end
  -- a weight gradient accumulated over two backwards (on CUDA the second
  -- GEMM adds into the existing .grad, beta = 1): equal to the CPU's
  local function twice(dev)
    local a = x:bf16():to(dev)
    local b = w:bf16():to(dev):detach():requires_grad(true)
    for _ = 1, 2 do a:matmul(b):float():sum():backward() end
    return b:get_grad()
  end
  same(twice("cpu"):float(), twice("cuda"):float(), 0.5, "matmul weight gradient accumulated twice (bf16)")
  -- a bias and a LayerNorm's weight and bias the same way (on CUDA summed
  -- straight into the .grad they have from the first backward)
  local function twice_bias_norm(dev)
    local a = x:bf16():to(dev)
    local bias = fsdp.randn(16, { seed = 23, device = "cpu" }):bf16():to(dev):detach():requires_grad(true)
    local lw = fsdp.randn(16, { seed = 24, device = "cpu" }):bf16():to(dev):detach():requires_grad(true)
    local lb = fsdp.randn(16, { seed = 25, device = "cpu" }):bf16():to(dev):detach():requires_grad(true)
    for _ = 1, 2 do ((a + bias):layernorm(lw, lb, 1e-5):float() * a:float()):sum():backward() end
    return bias:get_grad(), lw:get_grad(), lb:get_grad()
  end
  local cb, cw, cn = twice_bias_norm("cpu")
  local gb_, gw_, gn_ = twice_bias_norm("cuda")
  same(cb:float(), gb_:float(), 0.25, "bias gradient accumulated twice (bf16)")
  same(cw:float(), gw_:float(), 0.25, "layernorm weight gradient accumulated twice (bf16)")
  same(cn:float(), gn_:float(), 0.25, "layernorm bias gradient accumulated twice (bf16)")
  local xb = fsdp.randn(3, 5, 7, { seed = 21, device = "cpu" }):bf16()
  local wb = fsdp.randn(3, 7, 4, { seed = 22, device = "cpu" }):bf16()
  same(xb:matmul(wb):float(), xb:cuda():matmul(wb:cuda()):float(), 0.0625, "batched matmul (bf16)")
end

-- copies across devices
local d = fsdp.zeros(2, 3, { device = "cuda" })
d:copy(fsdp.tensor({ 1, 2, 3 }, { device = "cpu" }))   -- broadcast from the host
t.all_near(d:tolist(), { { 1, 2, 3 }, { 1, 2, 3 } }, 0, "copy cpu -> cuda, broadcasting")
local h = fsdp.zeros(3, 2, { device = "cpu", dtype = "bf16" })
h:copy(d:t())                                        -- and back, transposed, converted
t.all_near(h:tolist(), { { 1, 1 }, { 2, 2 }, { 3, 3 } }, 0, "copy cuda -> cpu, transposed, to bf16")

-- indices on the GPU: checked from the range they had on the host, and from
-- a host copy once anything wrote into them (the range no longer holds)
do
  local tbl = fsdp.randn(5, 3, { seed = 31, device = "cpu" })
  local ids = fsdp.tensor({ 0, 4, 2, 1 }, { dtype = "i64", device = "cpu" })
  local idc = ids:cuda()
  same(fsdp.embedding(tbl, ids), fsdp.embedding(tbl:cuda(), idc), 0, "embedding of host-given indices")
  t.raises(function() fsdp.embedding(tbl:cuda(), fsdp.tensor({ 0, 5, 1 }, { dtype = "i64", device = "cpu" }):cuda()) end,
    { "fsdp_embedding", "ids[1] is 5" }, "embedding: an index out of range, from the host")
  idc:copy(fsdp.tensor({ 1, 2, 7, 0 }, { dtype = "i64", device = "cpu" }))
  t.raises(function() fsdp.embedding(tbl:cuda(), idc) end, { "fsdp_embedding", "ids[2] is 7" },
    "embedding: an index written in after the host gave the tensor")
  idc:fill(-1)
  t.raises(function() fsdp.embedding(tbl:cuda(), idc) end, { "fsdp_embedding", "ids[0] is -1" },
    "embedding: indices filled on the device")
  -- the embedding's gradient (on CUDA: ids sorted on the device, each row's
  -- terms added in position order, one rounding): the CPU's bit for bit,
  -- written by the first backward and added into the .grad by the second;
  -- f32 and bf16 tables of 13 rows, 40 positions with repeated ids
  local list = {}
  for i = 1, 40 do list[i] = (i * i * 7) % 13 end
  local eids = fsdp.tensor(list, { dtype = "i64", device = "cpu" })
  local edout = fsdp.randn(40, 6, { seed = 33, device = "cpu" })
  for _, dt in ipairs({ "f32", "bf16" }) do
    local function cast(x) return dt == "bf16" and x:bf16() or x end
    local function grads(dev)
      local tb = cast(fsdp.randn(13, 6, { seed = 34, device = "cpu" })):to(dev):detach():requires_grad(true)
      local out = {}
      for k = 1, 2 do
        fsdp.embedding(tb, eids:to(dev)):backward(cast(edout):to(dev))
        out[k] = tb:get_grad():clone():float()
      end
      return out
    end
    local c, g = grads("cpu"), grads("cuda")
    same(c[1], g[1], 0, "embedding gradient (" .. dt .. "), first backward")
    same(c[2], g[2], 0, "embedding gradient (" .. dt .. "), added by the second")
    local moved = 0
    for r, row in ipairs(c[2]:tolist()) do
      for j, v in ipairs(row) do moved = math.max(moved, math.abs(v - c[1]:tolist()[r][j])) end
    end
    t.ok(moved > 0, "embedding gradient (" .. dt .. "): the second backward added to the first")
  end
  -- cross-entropy with every row counted (the mean on the device) and with ignored rows
  local logits = fsdp.randn(4, 6, { seed = 32, device = "cpu" })
  for _, tg in ipairs({ { 1, 5, 0, 2 }, { 1, -100, 0, -100 } }) do
    local y = fsdp.tensor(tg, { dtype = "i64", device = "cpu" })
    same(fsdp.cross_entropy(logits, y), fsdp.cross_entropy(logits:cuda(), y:cuda()), 1e-6,
      "cross_entropy, targets " .. table.concat(tg, " "))
    same(fsdp.cross_entropy(logits:bf16(), y):float(), fsdp.cross_entropy(logits:bf16():cuda(), y:cuda()):float(),
      1e-5, "cross_entropy on bf16 logits, targets " .. table.concat(tg, " "))
  end
  local yc = fsdp.tensor({ 1, 5, 0, 2 }, { dtype = "i64", device = "cpu" }):cuda()
  yc:copy(fsdp.tensor({ 1, 6, 0, 2 }, { dtype = "i64", device = "cpu" }))
  t.raises(function() fsdp.cross_entropy(logits:cuda(), yc) end, { "fsdp_cross_entropy", "targets[1] is 6" },
    "cross_entropy: a target written in after the host gave the tensor")
end

-- ---- collectives on CUDA tensors (the world: one rank here, or mpirun -np 1) ----
local function ok(st, what)
  if st ~= 0 then t.record(false, what, ffi.string(C.fsdp_last_error())) end
  return st == 0
end
local cbox, wbox = ffi.new("fsdp_comm *[1]"), ffi.new("fsdp_work *[1]")
if ok(C.fsdp_comm_world(cbox), "comm_world") then
  local world = cbox[0]
  local n = fsdp.world()
  if n == 1 then
    local src = fsdp.randn(6, { seed = 5, device = "cpu" })
    local dst = fsdp.zeros(6, { device = "cuda" })
    -- blocking
    if ok(C.fsdp_all_gather(nil, world, dst, src:cuda(), "ag"), "all_gather on cuda") then
      t.ok(bits_equal(dst:cpu(), src), "all_gather on cuda: values")
    end
    -- asynchronous: the work handle, then a kernel that consumes the result
    local out = fsdp.zeros(6, { device = "cuda" })
    if ok(C.fsdp_reduce_scatter(wbox, world, out, (src * 2):cuda(), 1, "rs"), "reduce_scatter on cuda") then
      local w = wbox[0]
      ok(C.fsdp_work_wait(w), "work_wait")
      ok(C.fsdp_work_free(w), "work_free")
      t.all_near((out + 0):cpu():tolist(), (src * 2):tolist(), 1e-6, "reduce_scatter avg on cuda: values")
    end
    local ar = src:cuda()
    if ok(C.fsdp_all_reduce(wbox, world, ar, 0, "ar"), "all_reduce on cuda") then
      local w, done = wbox[0], ffi.new("int[1]")
      ok(C.fsdp_work_wait(w), "all_reduce wait")
      ok(C.fsdp_work_test(w, done), "work_test")
      t.eq(done[0], 1, "work_test after wait: done")
      C.fsdp_work_free(w)
      t.ok(bits_equal(ar:cpu(), src), "all_reduce on cuda (one rank): unchanged")
    end
    local bc = src:bf16():cuda()
    if ok(C.fsdp_broadcast(nil, world, bc, 0, "bc"), "broadcast bf16 on cuda") then
      t.ok(bits_equal(bc:cpu(), src:bf16()), "broadcast on cuda: unchanged")
    end
    -- src overlapping dst, not in place: through scratch
    local buf = fsdp.arange(8, { device = "cpu" }):cuda()
    if ok(C.fsdp_all_gather(nil, world, buf:narrow(1, 1, 6), buf:narrow(1, 3, 6), "overlap"), "overlapping gather") then
      t.all_near(buf:cpu():tolist(), { 2, 3, 4, 5, 6, 7, 6, 7 }, 0, "overlapping all_gather on cuda")
    end
    -- in place: src is this rank's block of dst
    local ip = fsdp.arange(4, { device = "cpu" }):cuda()
    if ok(C.fsdp_all_gather(nil, world, ip, ip, "inplace"), "in-place gather") then
      t.all_near(ip:cpu():tolist(), { 0, 1, 2, 3 }, 0, "in-place all_gather on cuda")
    end
  end
  -- one device per collective, both named
  local st = C.fsdp_all_gather(nil, world, fsdp.zeros(n * 3, { device = "cuda" }), fsdp.zeros(3, { device = "cpu" }),
                               "mixed")
  local msg = ffi.string(C.fsdp_last_error())
  t.ok(st ~= 0 and msg:find("cuda", 1, true) and msg:find("cpu", 1, true) and msg:find("one device", 1, true),
       "a collective mixing devices is refused, naming both: " .. msg)
  C.fsdp_comm_free(world)
end

-- the default device can move to CUDA and back
fsdp.set_default_device("cuda")
t.eq(fsdp.zeros(3):device(), "cuda", "set_default_device(cuda): constructors follow")
t.eq(fsdp.default_device(), "cuda", "default_device after set")
fsdp.set_default_device(default)
t.eq(fsdp.default_device(), default, "default device restored")

t.done()
