-- A LoRA-style model under fsdp.shard: a frozen base (embedding, head, the
-- blocks' weights and norms) and small trainable adapters (x A^T B^T beside
-- each block's weight, 8% of the elements). The same model trained with
-- everything trainable is the reference: gradient memory, optimizer memory
-- and reduced bytes must fall with the trainable share, and match what the
-- layout implies exactly (reduced bytes, optimizer state) or within the
-- allocator's rounding (gradient peak). The allocator's statistics are
-- process-wide (one process per rank): the two runs go one after the other.
--   mpirun -np 2 fsdp-lua tests/distributed/test_fsdp_lora.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local Module = require "fsdp.nn.module"
local layers = require "fsdp.nn.layers"
local tr = require "fsdp.nn.transformer"
local planner = require "fsdp.plan"

local rank, world = fsdp.rank(), fsdp.world()
local V, C, L, R = 256, 64, 4, 8
local B, T = 2, 16

local LoRALinear = Module:extend("LoRALinear")
function LoRALinear:__init(n, r)
  self:add("base", layers.Linear(n, n, { bias = false }))
  self:add("lora_a", layers.Linear(n, r, { bias = false }))
  self:add("lora_b", layers.Linear(r, n, { bias = false }))
end
function LoRALinear:forward(x) return self.base(x) + self.lora_b(self.lora_a(x)) end

local Block = Module:extend("LoRABlock")
function Block:__init(n, r)
  self:add("ln", layers.LayerNorm(n))
  self:add("fc", LoRALinear(n, r))
end
function Block:forward(x) return x + self.fc(self.ln(x)):gelu() end

local Net = Module:extend("LoRANet")
function Net:__init()
  self:add("wte", layers.Embedding(V, C))
  local h = self:add("h", tr.ModuleList())
  for _ = 1, L do h:append(Block(C, R)) end
  self:add("head", layers.Linear(C, V, { bias = false }))
end
function Net:forward(ids, targets)
  local x = self.wte(ids)                                   -- (B, T, C)
  for i = 0, self.h.n - 1 do x = self.h:get(i)(x) end
  local logits = self.head(x)                               -- (B, T, V)
  return logits, fsdp.cross_entropy(logits:view(B * T, V), targets:view(B * T))
end

local function freeze_base(m)
  m:requires_grad(false)
  for i = 0, L - 1 do
    m.h:get(i).fc.lora_a:requires_grad(true)
    m.h:get(i).fc.lora_b:requires_grad(true)
  end
end

local block_numel = 2 * C + C * C + 2 * R * C
local adapter_numel = 2 * R * C
local root_numel = 2 * V * C
local total = root_numel + L * block_numel
local share = L * adapter_numel / total

-- bytes the allocator counts for a request of n: 64-byte steps up to 4 KiB,
-- then four steps per power of two (engine/core/alloc.c)
-- the allocator's rounding of an optimizer-tag block: 64-byte steps up to 4 KiB, then 64 per power of two
local function rounded(n)
  if n <= 4096 then return math.ceil(math.max(n, 1) / 64) * 64 end
  local base = 2 ^ math.floor(math.log(n - 1) / math.log(2))
  return base + math.ceil((n - base) / (base / 64)) * (base / 64)
end

local function pad(n) return math.max(1, math.ceil(n / world)) * world end

local tags = { "param", "grad", "optimizer", "comm" }
local function run(frozen)
  local model = Net()
  if frozen then freeze_base(model) end
  local base = {}
  for _, tag in ipairs(tags) do base[tag] = fsdp.memory.stats(tag).current end
  fsdp.memory.reset_peak()
  local sharded = fsdp.shard(model, { policy = fsdp.policy.by_type("LoRABlock"), seed = 3 })
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-2 })
  local losses, stats = {}, nil
  for step = 1, 3 do
    local x, y = t.token_batch(step * 31 + rank * 7, B, T, V)
    sharded:step_stats()
    local _, loss = model(x, y)
    loss:backward()
    stats = sharded:step_stats()
    opt:step()
    sharded:zero_grad()
    losses[step] = fsdp.distributed.mean(loss:item())
  end
  local r = { gathered = stats.gathered_bytes, reduced = stats.reduced_bytes, losses = losses, peak = {}, now = {} }
  for _, tag in ipairs(tags) do
    local s = fsdp.memory.stats(tag)
    r.peak[tag], r.now[tag] = s.peak - base[tag], s.current - base[tag]
  end
  -- this rank's optimizer state as AdamW allocates it: 2 f32 tensors per trainable slice
  r.expected_opt = 0
  for _, s in ipairs(sharded.segments) do
    if not s.frozen then r.expected_opt = r.expected_opt + 2 * rounded(4 * s.tensor:numel()) end
  end
  return r, base
end

local full = run(false)
collectgarbage("collect")
collectgarbage("collect")
local lora, base = run(true)

-- reduced bytes per step: each trainable unit's padded flat gradient, f32 (the
-- root's trainable part is empty: one padding element per rank)
-- (a group of one copies instead of communicating: nothing counted)
local comm = world > 1 and 1 or 0
local want_full = comm * 4 * (pad(root_numel) + L * pad(block_numel))
local want_lora = comm * 4 * (pad(0) + L * pad(adapter_numel))
t.eq(full.reduced, want_full, "all trainable: reduced bytes per step = 4 x padded units")
t.eq(lora.reduced, want_lora, "LoRA: reduced bytes per step = 4 x padded adapters")
t.eq(lora.gathered, full.gathered + comm * 4 * pad(0),
  "LoRA: the same gathered bytes (frozen weights are still gathered; plus the root's empty trainable part)")
t.eq(lora.now.optimizer, lora.expected_opt, "LoRA: AdamW state for the adapters' slices only")
t.eq(full.now.optimizer, full.expected_opt, "all trainable: AdamW state for every slice")
t.ok(lora.now.grad <= 4 * (pad(0) + L * pad(adapter_numel)) / world * 1.25 + 1024,
  string.format("LoRA: persistent gradient shards %d B, about the adapters' share", lora.now.grad))
local function ratio(a, b) return a / math.max(b, 1) end
for _, k in ipairs({ "grad", "optimizer" }) do
  local rr = ratio(lora.peak[k], full.peak[k])
  t.ok(rr <= 1.1 * share,
    string.format("LoRA %s peak %d B vs all trainable %d B: ratio %.3f, trainable share %.3f", k, lora.peak[k],
      full.peak[k], rr, share))
end
t.ok(comm == 0 or ratio(lora.reduced, full.reduced) <= 1.25 * share,
  string.format("LoRA reduced bytes ratio %.3f, trainable share %.3f", ratio(lora.reduced, full.reduced), share))
t.ok(lora.losses[3] < lora.losses[1], string.format("LoRA: the adapters learn (loss %.4f -> %.4f)", lora.losses[1],
  lora.losses[3]))
-- the planner runs the same fsdp.shard on the counting device: it must see
-- the same (run with FSDP_COMM_SYNC=1: collectives complete at issue, as there)
local lora_model = Net()
freeze_base(lora_model)
local plan = planner.plan(lora_model, { policy = fsdp.policy.by_type("LoRABlock"), seed = 3 }, world,
  { rank = rank, batch = B * world, ctx = T, steps = 3 })
t.eq(plan.traffic.reduced_bytes, lora.reduced, "planner: LoRA reduced bytes as measured")
t.eq(plan.memory.optimizer.current, lora.now.optimizer, "planner: LoRA optimizer state as measured")
t.eq(plan.memory.grad.current, lora.now.grad, "planner: LoRA gradient shards as measured")
if os.getenv("FSDP_COMM_SYNC") == "1" then
  t.eq(plan.memory.grad.peak, lora.peak.grad, "planner: LoRA gradient peak as measured")
end
if rank == 0 then
  print(string.format("planner: grad peak %d, optimizer %d, reduced %d", plan.memory.grad.peak,
    plan.memory.optimizer.current, plan.traffic.reduced_bytes))
  print(string.format("ranks=%d trainable share %.4f (%d of %d)", world, share, L * adapter_numel, total))
  print(string.format("%-12s %12s %12s %8s", "", "all", "lora", "ratio"))
  for _, row in ipairs({ { "grad peak", full.peak.grad, lora.peak.grad }, { "opt state", full.now.optimizer,
    lora.now.optimizer }, { "reduced", full.reduced, lora.reduced }, { "gathered", full.gathered, lora.gathered },
    { "param peak", full.peak.param, lora.peak.param }, { "comm peak", full.peak.comm, lora.peak.comm } }) do
    print(string.format("%-12s %12d %12d %8.3f", row[1], row[2], row[3], ratio(row[3], row[2])))
  end
end
t.done()
