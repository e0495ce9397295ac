-- fsdp.shard's compress option: bad settings are one error naming the
-- option; a world of one compresses nothing (the same bits as without, no
-- residual); on N ranks the gradient shards equal the compressed
-- reduction of the ranks' flat gradients (int8 within its quantization of
-- the exact average, top-k at density 1 exactly the average), the wire
-- bytes are the compressed ones, no_sync compresses only what is sent, and
-- a checkpoint resumes bit for bit (residuals restored), or says what
-- happened to residuals when only one side compresses.
-- A checkpoint saved on N ranks and loaded on M says its residuals were reset.
--   mpirun -np 2 fsdp-lua tests/distributed/test_compress_train.lua --dir=D
--   mpirun -np 3 fsdp-lua tests/distributed/test_compress_train.lua --dir=D --phase=save   (then -np 2 --phase=load)
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local ck = require "fsdp.checkpoint"
local compress = require "fsdp.compress"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local rank, world = fsdp.rank(), fsdp.world()
local cfg = { vocab_size = 61, n_layer = 2, n_head = 2, n_embd = 16, block_size = 8 }

local function shard(c, extra)
  local model = nn.GPT(cfg)
  local o = { policy = fsdp.policy.per_block(), seed = 3, compress = c }
  for k, v in pairs(extra or {}) do o[k] = v end
  return model, fsdp.shard(model, o)
end

-- ---- bad settings ----
local function bad(c, needle, name, extra)
  t.raises(function() shard(c, extra) end, { needle }, name)
end
bad({ grads = "int4" }, "compress.grads 'int4': unknown mode (expected none, int8 or topk)", "unknown mode")
bad({ grads = "topk", density = 0 }, "compress.density 0: expected a number in (0, 1]", "density 0")
bad({ grads = "topk", density = 1.5 }, "compress.density 1.5", "density above 1")
bad({ grads = "int8", block = 100 }, "compress.block 100: expected a positive power of two", "block 100")
bad({ grads = "int8", block = 0 }, "compress.block 0", "block 0")
bad({ grads = "int8", blocks = 4 }, "blocks", "a misspelt key")
bad({ grads = "int8" }, "compress.grads 'int8' with strategy no_shard", "no_shard", { strategy = "no_shard" })
bad({ params = "int8" }, "compress.params 'int8'", "weight gathers (not built)")
bad("int8", "compress must be a table", "not a table")

-- ---- data: each rank's rows of one global batch per step ----
local B, T = 4 * world, 8
local function batch(step, part, parts)
  local x, y = t.token_batch(100 + step, B, T, cfg.vocab_size)
  local per = B / world
  x, y = x:narrow(1, rank * per + 1, per), y:narrow(1, rank * per + 1, per)
  if parts then
    local r = per / parts
    x, y = x:narrow(1, (part - 1) * r + 1, r), y:narrow(1, (part - 1) * r + 1, r)
  end
  return x:contiguous(), y:contiguous()
end

local function train(model, sh, opt, from, to)
  local losses = {}
  for step = from, to do
    local x, y = batch(step)
    local _, loss = model(x, y)
    loss:backward()
    losses[#losses + 1] = fsdp.distributed.mean(loss:item())
    opt:step()
    sh:zero_grad()
  end
  return losses
end

local function masters(sh)
  local l = {}
  for i, u in ipairs(sh.units) do l[i] = u.master:tolist() end
  return l
end
local function residuals(sh)
  local l = {}
  for _, u in ipairs(sh.units) do
    local r = not u.frozen and compress.residual(sh, u.index)
    l[#l + 1] = r and r:tolist() or false
  end
  return l
end

-- ---- another rank count: --phase=save on N ranks, --phase=load on M ----
if opts.phase then
  local model, sh = shard({ grads = "int8" })
  local opt = optim.AdamW(sh:param_groups(0), { lr = 1e-2 })
  if opts.phase == "save" then
    train(model, sh, opt, 1, 1)
    ck.save(dir .. "/ranks", { model = sh, optim = opt, step = 1, extra = { world = world } })
    t.ok(true, "saved on " .. world .. " ranks")
  else
    local info = ck.load(dir .. "/ranks", { model = sh, optim = opt })
    local want = string.format("compression residuals reset to zero: saved on %d ranks, now %d", info.extra.world,
      world)
    t.ok(info.residuals and info.residuals:find(want, 1, true), "another rank count: " .. tostring(info.residuals))
    train(model, sh, opt, 2, 2)   -- and trains on
  end
  t.done()
  return
end

-- ---- a world of one: nothing to compress ----
if world == 1 then
  local m1, s1 = shard(nil)
  local m2, s2 = shard({ grads = "int8" })
  local o1, o2 = optim.AdamW(s1:param_groups(0), { lr = 1e-2 }), optim.AdamW(s2:param_groups(0), { lr = 1e-2 })
  train(m1, s1, o1, 1, 3)
  train(m2, s2, o2, 1, 3)
  t.eq(t.count_differ(masters(s1), masters(s2)), 0, "world of one: int8 compression changes no bit")
  local any = false
  for _, r in ipairs(residuals(s2)) do any = any or r ~= false end
  t.ok(not any, "world of one: no residual made")
  t.done()
  return
end

-- ---- N ranks: one backward's gradient shards against the ranks' flat gradients ----
-- The reference: the unsharded model's gradient on each rank's rows (every rank
-- computes every rank's), compressed per part as comm_compress.c describes is
-- checked in test_compress_collective.lua; here the shards must lie within
-- the quantization of the exact average, and top-k at density 1 be exact.
local function grads_after_backward(c)
  local model, sh = shard(c)
  local x, y = batch(1)
  local _, loss = model(x, y)
  loss:backward()
  local g = t.grad_lists(sh)
  local st = sh:step_stats()
  return g, st, sh
end
local exact, st_exact = grads_after_backward(nil)
local g8, st8, sh8 = grads_after_backward({ grads = "int8", block = 64 })
local gk, stk = grads_after_backward({ grads = "topk", density = 1 })
t.eq(t.count_differ(gk, exact, 1e-6), 0, "top-k at density 1: the exact average (within f32 rounding)")
local worst, scale = 0, 0
for i = 1, #exact do
  for j = 1, #exact[i] do
    worst = math.max(worst, math.abs(g8[i][j] - exact[i][j]))
    scale = math.max(scale, math.abs(exact[i][j]))
  end
end
t.ok(worst > 0 and worst <= scale / 127, string.format("int8: off the exact average by at most one quantum "
  .. "(%.3g, largest gradient %.3g)", worst, scale))
t.eq(st8.reduced_bytes, st_exact.reduced_bytes, "int8: logical reduced bytes as uncompressed")
t.ok(st_exact.reduced_bytes / st8.wire_reduced_bytes >= 3.5, string.format("int8: %.2fx fewer wire bytes than f32",
  st_exact.reduced_bytes / st8.wire_reduced_bytes))
t.eq(st_exact.wire_reduced_bytes, st_exact.reduced_bytes, "uncompressed: wire bytes are the logical ones")
local any = false
for _, r in ipairs(residuals(sh8)) do any = any or r ~= false end
t.ok(any, "int8 with error feedback keeps residuals")

-- ---- no_sync: two micro-batches, one compressed reduction ----
local function two_micro(c)
  local model, sh = shard(c)
  sh:step_stats()
  sh:no_sync(function()
    local x, y = batch(1, 1, 2)
    local _, l = model(x, y)
    l:backward()
  end)
  local st1, r1 = sh:step_stats(), residuals(sh)
  local x, y = batch(1, 2, 2)
  local _, l = model(x, y)
  l:backward()
  return t.grad_lists(sh), st1, r1, sh:step_stats(), residuals(sh)
end
do
  local ga = two_micro(nil)
  local gb, st1, r1, st2, r2 = two_micro({ grads = "int8", block = 64 })
  local none, some = true, false
  for i = 1, #r1 do none, some = none and r1[i] == false, some or r2[i] ~= false end
  t.eq(st1.wire_reduced_bytes, 0, "no_sync: nothing sent")
  t.ok(none, "no_sync: nothing compressed (no residual yet)")
  t.ok(some and st2.wire_reduced_bytes > 0, "the synced micro-batch sends compressed, once")
  local worst, scale = 0, 0
  for i = 1, #ga do
    for j = 1, #ga[i] do
      worst, scale = math.max(worst, math.abs(gb[i][j] - ga[i][j])), math.max(scale, math.abs(ga[i][j]))
    end
  end
  t.ok(worst <= scale / 127, "no_sync: the accumulated gradient within one quantum of the exact one")
end

-- ---- resume bit for bit ----
local function fresh(c)
  local model, sh = shard(c)
  return model, sh, optim.AdamW(sh:param_groups(0), { lr = 1e-2 })
end
for _, c in ipairs({ { grads = "int8", block = 32 }, { grads = "topk", density = 0.05 } }) do
  local name = c.grads
  local m1, s1, o1 = fresh(c)
  local straight = train(m1, s1, o1, 1, 4)
  local m2, s2, o2 = fresh(c)
  train(m2, s2, o2, 1, 2)
  local path = dir .. "/ckpt_" .. name
  ck.save(path, { model = s2, optim = o2, step = 2 })
  local m3, s3, o3 = fresh(c)
  local info = ck.load(path, { model = s3, optim = o3 })
  t.eq(info.residuals, nil, name .. ": residuals restored silently")
  t.eq(t.count_differ(residuals(s3), residuals(s2)), 0, name .. ": residuals restored bit for bit")
  local resumed = train(m3, s3, o3, 3, 4)
  t.eq(t.count_differ(masters(s3), masters(s1)), 0, name .. ": resumed run equals the straight one bit for bit")
  t.eq(resumed[2], straight[4], name .. ": last loss equal")
  -- the other way round: a run without compression, and one with, from each other's checkpoints
  local m4, s4, o4 = fresh(nil)
  local i4 = ck.load(path, { model = s4, optim = o4 })
  t.ok(i4.residuals and i4.residuals:find("not used: this run does not compress", 1, true),
    name .. ": loaded without compression says so (" .. tostring(i4.residuals) .. ")")
  ck.save(path .. "_plain", { model = s4, optim = o4, step = 2 })
  local m5, s5, o5 = fresh(c)
  train(m5, s5, o5, 1, 1)   -- makes residuals, which the load must zero
  local i5 = ck.load(path .. "_plain", { model = s5, optim = o5 })
  t.ok(i5.residuals and i5.residuals:find("start from zero", 1, true),
    name .. ": loaded with compression from a plain checkpoint says so")
  local zero = true
  for _, r in ipairs(residuals(s5)) do
    for _, v in ipairs(r or {}) do zero = zero and v == 0 end
  end
  t.ok(zero, name .. ": and its residuals are zero")
end

t.done()
