-- The one-host collectives through shared memory (FSDP_COMM_SHM) against
-- MPI's: the tiny GPT trained a few AdamW steps with clipping under a given
-- strategy, its losses and final parameters written bit for bit (%a) to
-- --out on rank 0, so that a run with FSDP_COMM_SHM=1 and one with 0 can be
-- compared byte for byte (tests/distributed/shm_bits.sh). --expect=shm: the
-- gathers and reduce-scatters went through shared memory, none through MPI
-- for want of a shared buffer; --expect=mpi: none through shared memory.
-- Awkward sizes: a prime vocabulary and units whose sizes the rank counts do
-- not divide (padded shards).
--   mpirun -np 3 fsdp-lua tests/distributed/test_fsdp_shm.lua --strategy=full_shard --expect=shm --out=a.txt
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"

local opts = ... or {}
local strategy = opts.strategy or "full_shard"
local expect = opts.expect or "shm"
local dtype = opts.compute or "f32"
local rank, world = fsdp.rank(), fsdp.world()
assert(expect == "shm" or expect == "mpi", "--expect=shm or --expect=mpi")

-- --head-chunk=R: the head and loss by vocabulary chunks (the tied embedding
-- a sliced unit, gathered and reduced by slices); --reshard=G: hpZ groups of G
local cfg = { vocab_size = 97, n_layer = 2, n_head = 2, n_embd = 14, block_size = 8,
  head_chunk = tonumber(opts.head_chunk) }
local B, T, STEPS, SEED = 12, 8, 4, 11
local model = nn.GPT(cfg)
local sharded = fsdp.shard(model, {
  policy = fsdp.policy.by_size(500), strategy = strategy, group_size = opts.group_size, seed = SEED,
  mixed_precision = { compute = dtype, reduce = "f32" }, offload = opts.offload == true,
  reshard_after_forward = tonumber(opts.reshard),
})
local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8 })
assert(B % world == 0, "batch not divisible")
local mine = B / world

local lines, shared, fallback = {}, 0, 0
sharded:step_stats()
for step = 1, STEPS do
  local x, y = t.token_batch(step * 7919 + 17, B, T, cfg.vocab_size)
  local xs, ys = x:narrow(1, rank * mine + 1, mine):contiguous(), y:narrow(1, rank * mine + 1, mine):contiguous()
  local _, l = model(xs, ys, { logits = false })
  l:backward()
  local loss = fsdp.distributed.mean(l:item())
  sharded:clip_grad_norm(0.5)
  opt:step()
  sharded:zero_grad()
  lines[#lines + 1] = string.format("step %d loss %a", step, loss)
  local s = sharded:step_stats()
  shared, fallback = shared + s.shm_collectives, fallback + s.shm_fallbacks
end

local full = sharded:full_state_dict()
for _, p in ipairs(model:named_parameters()) do
  local v = full[p.path]:float():view(-1):tolist()
  local parts = {}
  for i = 1, #v do parts[i] = string.format("%a", v[i]) end
  lines[#lines + 1] = p.path .. " " .. table.concat(parts, " ")
end

if world > 1 and expect == "shm" then
  t.ok(shared > 0, string.format("rank %d: %d collectives through shared memory", rank, shared))
  t.eq(fallback, 0, string.format("rank %d: collectives sent through MPI for want of a shared buffer", rank))
else
  t.eq(shared, 0, string.format("rank %d: collectives through shared memory", rank))
end
if rank == 0 and opts.out then
  local f = assert(io.open(opts.out, "w"))
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
end
if rank == 0 then
  print(string.format("%s ranks=%d compute=%s: %d through shared memory, %d fallbacks (rank 0)", strategy, world,
    dtype, shared, fallback))
end
t.done()
