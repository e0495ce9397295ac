-- A small sharded GPT trained for 3 steps, for tests/sh/test_trace.sh: its
-- timeline (--trace=FILE) is then checked by tests/sh/check_trace.lua.
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local cfg = { vocab_size = 64, n_layer = 2, n_head = 2, n_embd = 32, block_size = 16 }
local model = nn.GPT(cfg)
-- "hybrid": hybrid_shard over groups of 2 (replica all-reduces on their own comm lane)
local hybrid = arg and arg[1] == "hybrid"
local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 3,
                                    strategy = hybrid and "hybrid_shard" or nil, group_size = hybrid and 2 or nil })
local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-3 })
for step = 1, 3 do
  local x, y = t.token_batch(step * 31 + fsdp.rank(), 2, 16, cfg.vocab_size)
  local _, loss = model(x, y)
  loss:backward()
  sharded:clip_grad_norm(1.0)
  opt:step()
  sharded:zero_grad()
end
print("trained on " .. tostring(fsdp.default_device()))
