-- The masters' bf16 compute copies (fsdp.shard's compute_copy): AdamW
-- writes each unit's copy as it updates the master, the gathers send it
-- instead of casting. A model trained with them must follow, bit for bit,
-- the same model trained without (every gather casting its master): the
-- copy is the cast. Checked here, for a strategy and options given on the
-- command line, on the ranks of the run:
--   * after every AdamW step each unit's copy is current and equals a fresh
--     cast of its master, bit for bit;
--   * each other writer of a master (copy, fill, random init, scale_,
--     axpy_, SGD, a collective, a write through data_ptr, summon_full_params
--     with writeback, writes into gathered parameters, a checkpoint load into
--     the live model, an import) leaves the copy stale, and the step after
--     it is again bit for bit the step of the run without copies;
--   * a checkpoint saved with copies and loaded into a new model resumes
--     bit for bit as the run without copies goes on;
--   * losses and masters of both runs are equal at every step.
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_compute_copy.lua --strategy=full_shard
-- --offload: shards in host memory (copies there too: compute_copy = true);
-- --head-chunk=R: the tied embedding a sliced unit (gathered by slices);
-- --hpz=G: reshard_after_forward = G (the backward regathers the kept parts).
package.path = "tests/lua/?.lua;" .. package.path
local ffi = require "ffi"
local t = require "testlib"
local fsdp = require "fsdp"
local core = require "fsdp.core"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local ck = require "fsdp.checkpoint"

local opts = ... or {}
local strategy = opts.strategy or "full_shard"
local rank, world = fsdp.rank(), fsdp.world()
local C = core.C

local cfg = { vocab_size = 96, n_layer = 2, n_head = 2, n_embd = 16, block_size = 8, head_chunk = opts.head_chunk }
local B, T, SEED = 12, 8, 7
local mine = B / world
assert(mine == math.floor(mine), "batch not divisible by the ranks")

local function batch(step)
  local x, y = t.token_batch(step * 7919 + 17, B, T, cfg.vocab_size)
  return x:narrow(1, rank * mine + 1, mine):contiguous(), y:narrow(1, rank * mine + 1, mine):contiguous()
end

local function make(copy)
  local model = nn.GPT(cfg)
  local sharded = fsdp.shard(model, {
    policy = fsdp.policy.per_block(), strategy = strategy, group_size = opts.group_size, seed = SEED,
    mixed_precision = { compute = "bf16", reduce = "f32" }, offload = opts.offload == true,
    compute_copy = copy, reshard_after_forward = opts.hpz and tonumber(opts.hpz) or nil,
  })
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8 })
  return { model = model, sharded = sharded, opt = opt, copy = copy }
end

-- exact text of every value (%a tells -0 from 0 too)
local function bits(x)
  local flat, out = x:float():cpu():view(-1):tolist(), {}
  for i, v in ipairs(flat) do out[i] = string.format("%a", v) end
  return out
end

local function same(a, b)
  if #a ~= #b then return false, string.format("%d values vs %d", #a, #b) end
  for i = 1, #a do
    if a[i] ~= b[i] then return false, string.format("element %d: %s vs %s", i, a[i], b[i]) end
  end
  return true
end

local function step(run, s)
  local x, y = batch(s)
  local _, loss = run.model(x, y)
  loss:backward()
  local l = fsdp.distributed.mean(loss:item())
  run.sharded:clip_grad_norm(0.5)
  run.opt:step()
  run.sharded:zero_grad()
  return l
end

-- every unit's copy current and equal to a fresh cast of its master
local function check_copies(run, what)
  for _, u in ipairs(run.sharded.units) do
    local copy, current = run.sharded:compute_copy(u)
    t.ok(copy ~= nil and current, string.format("%s: unit %s keeps a current copy", what, u.name))
    if copy then
      t.eq(copy:dtype(), "bf16", what .. ": the copy is bf16")
      local ok, why = same(bits(copy), bits(u.master:bf16()))
      t.ok(ok, string.format("%s: copy of %s equals the cast of its master (%s)", what, u.name, why or ""))
    end
  end
end

local function compare(a, b, what)
  for k, u in ipairs(a.sharded.units) do
    local ok, why = same(bits(u.master), bits(b.sharded.units[k].master))
    t.ok(ok, string.format("%s: master of %s equal with and without copies (%s)", what, u.name, why or ""))
  end
end

local function stale(run, unit, what)
  local _, current = run.sharded:compute_copy(unit)
  t.ok(not current, what .. ": the copy of " .. unit.name .. " is stale after the write")
end

-- ---- the writers: each applied to both runs, then a step of each ----

local function first_seg(run) return run.sharded.segments[1].tensor end

local on_device = fsdp.default_device() ~= "cpu" and not opts.offload
-- one directory for every rank: rank 0's unique name (runs at the same time must not share one)
local ckdir = fsdp.distributed.broadcast(rank == 0 and os.tmpname() or "", 0)
local ckfile = ckdir
ckdir = ckdir .. "_copy_ck"

local writers = {
  { "copy", function(run) local s = first_seg(run); s:copy(s * 0.5) end, unit = 1 },
  { "fill", function(run) run.sharded.units[2].master:fill(0.01) end },
  { "init", function(run) run.sharded.units[2].master:normal_(0, 0.02, 11, 3, 0) end },
  { "scale_", function(run)
    if C.fsdp_scale_(run.sharded.units[2].master, 0.75) ~= 0 then core.raise() end
  end },
  { "axpy_", function(run)
    local m = run.sharded.units[2].master
    if C.fsdp_axpy_(m, m * 0.25, 1.0) ~= 0 then core.raise() end
  end },
  { "sgd", function(run)
    -- a different optimizer over the same shards (gradients are zero now: weight decay moves them)
    optim.SGD(run.sharded:parameters(), { lr = 0.1, weight_decay = 0.5 }):step()
  end, unit = "all" },
  { "broadcast", function(run)
    if C.fsdp_broadcast(nil, run.sharded.shard_comm, run.sharded.units[2].master, 0, "copy test") ~= 0 then
      core.raise()
    end
  end },
  { "summon", function(run)
    run.sharded:summon_full_params(function()
      local w = run.model.h:get(0).attn.c_attn.weight
      w:copy(w * 1.5)
    end)
  end, unit = "all" },
  -- written while gathered and thrown away (no writeback): the masters
  -- keep their values, and so must what the next gather sends
  { "gathered", function(run)
    run.sharded:summon_full_params({ writeback = false }, function()
      run.model.h:get(0).attn.c_attn.weight:fill(3.0)
      run.model.wte.weight:fill(-2.0)
    end)
  end, keeps_master = true },
  -- the state saved before the writers, loaded into the live model
  { "load", function(run) ck.load(ckdir .. "/" .. (run.copy and "a" or "b"), { model = run.sharded, optim = run.opt }) end,
    unit = "all" },
  { "import", function(run)
    ck.import(ckdir .. "/export.safetensors", run.sharded)
  end, unit = "all" },
}
if not on_device and not opts.offload then
  writers[#writers + 1] = { "data_ptr", function(run)
    local m = run.sharded.units[2].master
    local p = ffi.cast("float *", m:data_ptr())
    for i = 0, m:numel() - 1, 3 do p[i] = p[i] * -1 end
  end }
end

local a, b = make(true), make(false)
local s = 0
local function both(what)
  s = s + 1
  local la, lb = step(a, s), step(b, s)
  t.ok(string.format("%a", la) == string.format("%a", lb),
    string.format("%s (step %d): loss %.9g with copies, %.9g without", what, s, la, lb))
  check_copies(a, what)
  compare(a, b, what)
end

for _ = 1, 3 do both("plain") end
-- a checkpoint of each run now, and a full export (what load and import bring back later)
ck.save(ckdir .. "/a", { model = a.sharded, optim = a.opt, step = s })
ck.save(ckdir .. "/b", { model = b.sharded, optim = b.opt, step = s })
ck.export(ckdir .. "/export.safetensors", b.sharded)
-- saving and reading values only read the masters: the copies stay current
ck.export(ckdir .. "/export_a.safetensors", a.sharded)
for _, u in ipairs(a.sharded.units) do
  local _ = u.master:tolist()
  local _, current = a.sharded:compute_copy(u)
  t.ok(current, "a checkpoint save, an export and tolist leave the copy of " .. u.name .. " current")
end
local saved_at = s
both("after save")

for _, w in ipairs(writers) do
  local name, fn = w[1], w[2]
  fn(a)
  fn(b)
  if not w.keeps_master then   -- the units the writer touched: unit 2 unless it says
    for k, u in ipairs(a.sharded.units) do
      if w.unit == "all" or k == (w.unit or 2) then stale(a, u, name) end
    end
  end
  compare(a, b, name .. " (before its step)")
  both(name)
end

-- AdamW while a gather reads the copy (h.0 unsharded on request, in flight
-- or, on one rank, the copy itself as the unit's buffer): the copy is left
-- alone and stale, the next gather casts it again
local function step_unsharded(run, x)
  local xs, ys = batch(x)
  local _, loss = run.model(xs, ys)
  loss:backward()
  local l = fsdp.distributed.mean(loss:item())
  run.sharded:clip_grad_norm(0.5)
  local h = run.sharded:unshard("h.0", { async = true })
  run.opt:step()
  h:wait()
  run.sharded:reshard("h.0")
  run.sharded:zero_grad()
  return l
end
s = s + 1
local la, lb = step_unsharded(a, s), step_unsharded(b, s)
t.ok(string.format("%a", la) == string.format("%a", lb), "AdamW while h.0 is gathered: the same loss")
-- (offloaded shards: the gather sends a device copy of the host's copy, which it does not read after)
local offloaded = opts.offload and fsdp.default_device() ~= "cpu"
for _, u in ipairs(a.sharded.units) do
  local _, current = a.sharded:compute_copy(u)
  local read = u.name == "h.0" and not offloaded
  t.eq(current, not read, "AdamW while h.0 is gathered: the copy of " .. u.name .. (read and " is stale" or " is current"))
end
compare(a, b, "AdamW while h.0 is gathered")
both("after AdamW while gathered")

-- resume: a new model with copies loads the checkpoint of the run with copies
-- and goes on as the run without copies did from the same point
local c, d = make(true), make(false)
ck.load(ckdir .. "/a", { model = c.sharded, optim = c.opt })
ck.load(ckdir .. "/b", { model = d.sharded, optim = d.opt })
for k = 1, 2 do
  local x = saved_at + k
  local lc, ld = step(c, x), step(d, x)
  t.ok(string.format("%a", lc) == string.format("%a", ld),
    string.format("resumed step %d: loss %.9g with copies, %.9g without", x, lc, ld))
  check_copies(c, "resumed")
  compare(c, d, "resumed")
end

-- the copies are optional: false keeps none; true with f32 compute is refused by the engine
for _, u in ipairs(b.sharded.units) do
  local copy = b.sharded:compute_copy(u)
  t.ok(copy == nil, "compute_copy = false: unit " .. u.name .. " keeps no copy")
end
t.raises(function() fsdp.shard(nn.GPT(cfg), { compute_copy = "yes" }) end, "compute_copy must be true, false or nil",
  "a compute_copy that is not a boolean")

-- no room for a copy (a memory cap at what is reserved now): the gather
-- fails with a message naming the unit and the way out, not a crash
do
  local e = make(true)
  local xs, ys = batch(1)
  local device = on_device and fsdp.default_device() or (opts.offload and "cpu" or nil)
  fsdp.memory.empty_cache(device)
  fsdp.memory.set_cap(fsdp.memory.stats(nil, device).reserved, device)
  local ok, err = pcall(function() e.model(xs, ys) end)
  fsdp.memory.set_cap(0, device)
  t.ok(not ok and tostring(err):find("compute copy", 1, true) and tostring(err):find("compute_copy = false", 1, true),
    "a copy that does not fit: " .. tostring(err))
  fsdp.tape_clear()
end

fsdp.distributed.barrier()
if rank == 0 then
  os.execute("rm -rf '" .. ckdir .. "'")
  os.remove(ckfile)
end
t.done()
