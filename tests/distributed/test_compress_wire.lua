-- Wire bytes beside logical bytes: one training step of a small GPT on N
-- ranks per compression setting, through fsdp.metrics (the --metrics
-- records and the log line). The expected wire bytes are computed here from
-- the units' padded sizes and the wire layout (per rank's part of n
-- elements: int8 = 4 * ceil(n / block) scale bytes + n values padded to a
-- multiple of 4; top-k = ceil(density * n) int32 indices + as many f32
-- values), N parts per unit reduction; uncompressed, wire = logical.
--   mpirun -np 2 fsdp-lua tests/distributed/test_compress_wire.lua --dir=D
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local metrics = require "fsdp.metrics"
local json = require "fsdp.json"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
os.execute("mkdir -p '" .. dir .. "'")
local rank, world = fsdp.rank(), fsdp.world()
assert(world >= 2, "run on 2 or more ranks")
-- awkward sizes: vocab 61, n_embd 12 (units not multiples of the block)
local cfg = { vocab_size = 61, n_layer = 2, n_head = 2, n_embd = 12, block_size = 8 }

local function part_bytes(c, n)
  if c == nil then return 4 * n end
  if c.grads == "int8" then return 4 * math.ceil(n / c.block) + math.ceil(n / 4) * 4 end
  local k = math.max(1, math.min(n, math.ceil(c.density * n)))
  return 8 * k
end

local function one_step(c, name)
  local model = nn.GPT(cfg)
  local sh = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 3, compress = c })
  local opt = optim.AdamW(sh:param_groups(0), { lr = 1e-2 })
  local path = dir .. "/" .. name .. ".jsonl"
  local m = metrics.new { path = path, tokens_per_step = 4 * world * 8, peak_flops = 1e12 }
  m:begin_step()
  local x, y = t.token_batch(7, 4 * world, 8, cfg.vocab_size)
  x, y = x:narrow(1, rank * 4 + 1, 4):contiguous(), y:narrow(1, rank * 4 + 1, 4):contiguous()
  local _, loss = model(x, y)
  loss:backward()
  opt:step()
  opt:zero_grad()
  local rec = m:end_step { step = 1, loss = loss:item() }
  local line = m:format(rec)
  m:close()
  local logical, wire, units = 0, 0, 0
  for _, u in ipairs(sh.units) do
    if not u.frozen then
      local n = u.padded / world
      t.eq(n, math.floor(n), name .. ": unit " .. u.name .. " padded to a multiple of the ranks")
      logical = logical + 4 * u.padded
      wire = wire + world * part_bytes(c, n)
      units = units + 1
    end
  end
  local file
  if rank == 0 then
    local f = assert(io.open(path, "r"))
    for l in f:lines() do
      local r = json.decode(l)
      if r.type == "step" then file = r end
    end
    f:close()
  end
  return rec, file, line, logical, wire, units
end

local settings = {
  { name = "none", c = nil },
  { name = "int8_b64", c = { grads = "int8", block = 64 } },
  { name = "int8_b1", c = { grads = "int8", block = 1 } },
  { name = "int8_b256", c = { grads = "int8", block = 256 } },
  { name = "topk_0.05", c = { grads = "topk", density = 0.05 } },
  { name = "topk_1", c = { grads = "topk", density = 1 } },
}
local gathered_ref
for _, s in ipairs(settings) do
  local rec, file, line, logical, wire, units = one_step(s.c, s.name)
  t.ok(units >= 3, s.name .. ": " .. units .. " units reduce")
  t.eq(rec.reduced_bytes, logical, s.name .. ": logical reduced bytes = 4 * padded elements per unit")
  t.eq(rec.wire_reduced_bytes, wire, string.format("%s: wire reduced bytes %d, expected %d", s.name,
    rec.wire_reduced_bytes, wire))
  t.eq(rec.wire_gathered_bytes, rec.gathered_bytes, s.name .. ": gathers uncompressed: wire = logical")
  gathered_ref = gathered_ref or rec.gathered_bytes
  t.eq(rec.gathered_bytes, gathered_ref, s.name .. ": gathered bytes as uncompressed")
  if rank == 0 then
    t.ok(file ~= nil, s.name .. ": the --metrics file has a step record")
    t.eq(file.wire_reduced_bytes, wire, s.name .. ": the record's wire_reduced_bytes")
    t.eq(file.reduced_bytes, logical, s.name .. ": the record's reduced_bytes")
    t.eq(file.wire_gathered_bytes, file.gathered_bytes, s.name .. ": the record's wire_gathered_bytes")
  end
  local shows = line:find(string.format("reduced %.2f MiB (wire %.2f MiB)", logical / 2 ^ 20, wire / 2 ^ 20), 1, true)
  if s.c then t.ok(shows, s.name .. ": the log line shows the wire bytes: " .. line)
  else t.ok(not line:find("wire", 1, true), "uncompressed: the log line adds nothing: " .. line) end
  if s.name == "int8_b256" then
    t.ok(logical / wire >= 3.5, string.format("int8: %.2fx fewer bytes than f32", logical / wire))
  end
end

t.done()
