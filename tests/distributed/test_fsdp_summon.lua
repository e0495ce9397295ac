-- summon_full_params writes back by default: a parameter changed inside it
-- keeps the change after resharding (every rank's slice), and a step's
-- forward sees it; with { writeback = false } the change is discarded.
--   mpirun -np 3 fsdp-lua tests/distributed/test_fsdp_summon.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"

local rank = fsdp.rank()
local cfg = { vocab_size = 96, n_layer = 2, n_head = 2, n_embd = 16, block_size = 8 }
local model = nn.GPT(cfg)
local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 2 })
local before = sharded:full_state_dict()

-- writeback (the default): h.1's c_fc weight becomes 0.25, the root's wpe doubles
local got = sharded:summon_full_params(function()
  model.h:get(1).mlp.c_fc.weight:fill(0.25)
  model.wpe.weight:copy(model.wpe.weight * 2)
  return "result"
end)
t.eq(got, "result", "summon_full_params returns fn's results")
local after = sharded:full_state_dict()
local w = after["h.1.mlp.c_fc.weight"]:view(-1):tolist()
local all = true
for i = 1, #w do all = all and w[i] == 0.25 end
t.ok(all, string.format("rank %d: h.1.mlp.c_fc.weight written back (%d elements, every rank's slice)", rank, #w))
local a, b = after["wpe.weight"]:view(-1):tolist(), before["wpe.weight"]:view(-1):tolist()
local doubled = true
for i = 1, #a do doubled = doubled and math.abs(a[i] - 2 * b[i]) <= 1e-7 end
t.ok(doubled, "wpe.weight (the root unit) written back")
local c, d = after["h.0.mlp.c_fc.weight"]:view(-1):tolist(), before["h.0.mlp.c_fc.weight"]:view(-1):tolist()
local same = true
for i = 1, #c do same = same and c[i] == d[i] end
t.ok(same, "an untouched parameter is unchanged")

-- writeback = false: discarded
sharded:summon_full_params({ writeback = false }, function() model.h:get(0).attn.c_attn.weight:fill(7) end)
local e = sharded:full_state_dict()["h.0.attn.c_attn.weight"]:view(-1):tolist()
local f = before["h.0.attn.c_attn.weight"]:view(-1):tolist()
local kept = true
for i = 1, #e do kept = kept and e[i] == f[i] end
t.ok(kept, "writeback = false discards the change")

t.raises(function() sharded:summon_full_params({ write_back = false }, function() end) end,
  { "summon_full_params", "write_back" }, "a misspelled option is an error")
t.raises(function() sharded:summon_full_params({ writeback = 1 }, function() end) end,
  { "writeback must be true or false" }, "writeback must be a boolean")
t.done()
