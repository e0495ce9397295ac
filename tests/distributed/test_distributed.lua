-- fsdp.distributed on 1, 2 and 3 ranks: reductions of numbers and lists
-- against closed forms, broadcasts of awkward strings and tables from
-- every root, groups split by parity, print0 on rank 0 only, argument
-- errors, and no binding exported to recipes.
--   mpirun -np 3 fsdp-lua tests/distributed/test_distributed.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local dist = require "fsdp.distributed"

local rank, world = dist.rank(), dist.world()
t.eq(fsdp.distributed, dist, "fsdp.distributed is the module")
t.eq(fsdp.rank(), rank, "fsdp.rank() = dist.rank()")
t.eq(fsdp.world(), world, "fsdp.world() = dist.world()")
t.ok(rank >= 0 and rank < world, string.format("rank %d of %d", rank, world))
local lr = dist.local_rank()
t.ok(lr >= 0 and lr < world, "local rank " .. lr .. " within the ranks (one host here)")
t.eq(dist.is_main(), rank == 0, "is_main on rank 0 only")
t.eq(fsdp.C, nil, "fsdp does not export the binding (fsdp.C)")
t.eq(fsdp.core, nil, "fsdp does not export fsdp.core")

-- ---- reductions: rank r contributes r + 1 ----
local v = rank + 1
t.eq(dist.sum(v), world * (world + 1) / 2, "sum of 1..N")
t.eq(dist.mean(v), (world + 1) / 2, "mean of 1..N")
t.eq(dist.max(v), world, "max of 1..N")
t.eq(dist.min(v), 1, "min of 1..N")
t.eq(dist.min(-v), -world, "min of negatives")
local l = { v, -2 * v, 7, 2 ^ 40 + v }
local s = dist.sum(l)
t.eq(#s, 4, "a list comes back as a list of the same length")
t.eq(s[1], world * (world + 1) / 2, "list sum, entry 1")
t.eq(s[2], -world * (world + 1), "list sum, entry 2")
t.eq(s[3], 7 * world, "list sum, entry 3 (same on every rank)")
t.eq(s[4], world * 2 ^ 40 + world * (world + 1) / 2, "list sum, large values stay exact")
local mx, mn = dist.max(l), dist.min(l)
t.eq(mx[1], world, "list max")
t.eq(mx[2], -2, "list max of negatives")
t.eq(mn[1], 1, "list min")
t.eq(mn[2], -2 * world, "list min of negatives")
t.eq(#dist.sum({}), 0, "an empty list")
t.eq(l[1], v, "the argument list is left as it was")
t.raises(function() dist.sum("3") end, { "fsdp.distributed.sum", "a number or a list of numbers", "string" },
  "sum of a string")
t.raises(function() dist.max({ 1, "x" }) end, { "fsdp.distributed.max", "entry 2" }, "max of a list with a string")

-- ---- broadcast: strings of every byte value and length, tables, scalars ----
local all_bytes = {}
for i = 0, 255 do all_bytes[#all_bytes + 1] = string.char(i) end
all_bytes = table.concat(all_bytes)
for root = 0, world - 1 do
  local mine = rank == root
  for _, n in ipairs({ 0, 1, 5, 6, 7, 256, 1001 }) do
    local want = (all_bytes:rep(4) .. "end"):sub(1, n) .. tostring(root)
    local got = dist.broadcast(mine and want or "ignored on other ranks", root)
    t.eq(got, want, string.format("root %d: string of %d bytes", root, #want))
  end
  local tab = dist.broadcast(mine and { name = "gpt", sizes = { 1, 2, 3 }, on = true, lr = 1.5e-4, root = root } or
    nil, root)
  t.ok(type(tab) == "table" and tab.name == "gpt" and tab.on == true and tab.lr == 1.5e-4 and tab.root == root,
    string.format("root %d: a table", root))
  t.ok(type(tab) == "table" and #tab.sizes == 3 and tab.sizes[3] == 3, string.format("root %d: a nested list", root))
  t.eq(dist.broadcast(mine and 42.5 or 0, root), 42.5, string.format("root %d: a number", root))
  t.eq(dist.broadcast(not mine, root), false, string.format("root %d: a boolean (the root sends false)", root))
  t.eq(dist.broadcast(nil, root), nil, string.format("root %d: nil", root))
end
t.raises(function() dist.broadcast("x", world) end, { "fsdp.distributed.broadcast", "root " .. world }, "root out of range")
if world > 1 then
  -- a value the root cannot send is an error on every rank, not a hang
  t.raises(function() dist.broadcast(rank == 0 and print or "x", 0) end, { "rank 0 (the root)", "cannot send a function" },
    "broadcast of a function fails on every rank")
end

-- ---- groups ----
local wg = dist.world_group()
t.eq(wg:size(), world, "the world group's size")
t.eq(wg:rank(), rank, "the world group's rank")
local color = rank % 2
local g = wg:split(color)
local members = math.floor((world - 1 - color) / 2) + 1
t.eq(g:size(), members, "parity group size")
t.eq(g:rank(), math.floor(rank / 2), "parity group rank, ordered by world rank")
t.eq(g:sum(1), members, "sum of ones over the group")
t.eq(g:max(rank), color + 2 * (members - 1), "max world rank in the group")
t.eq(g:broadcast(g:rank() == 0 and ("leader " .. rank) or "", 0), "leader " .. color, "broadcast within a group")
t.no_error(function() g:barrier() end, "barrier in a group")
t.no_error(function() dist.barrier() end, "barrier in the world")
t.ok(tostring(g):find("group", 1, true) ~= nil, "a group prints as one")
g:free()
t.raises(function() g:sum(1) end, "the group was freed", "a freed group refuses collectives")
t.raises(function() wg:split(-1) end, "non-negative integer", "split with a negative color")

-- ---- print0: one line, on rank 0 ----
local real = io.stdout
local lines = {}
io.stdout = { write = function(_, ...) lines[#lines + 1] = table.concat({ ... }) end }
local ok, err = pcall(function()
  dist.print0("step %d | loss %.2f", 3, 1.5)
  dist.print0("a", 1, true)
  dist.print0("100%")
end)
io.stdout = real
t.ok(ok, "print0 ran: " .. tostring(err))
if rank == 0 then
  t.eq(table.concat(lines), "step 3 | loss 1.50\na\t1\ttrue\n100%\n", "rank 0 prints formatted and plain lines")
else
  t.eq(#lines, 0, "rank " .. rank .. " prints nothing")
end

-- ---- a sharded model's groups ----
local nn = require "fsdp.nn"
local sh = fsdp.shard(nn.Linear(3, 5), { seed = 1 })
t.eq(sh.group:size(), world, "sharded.group spans every rank")
t.eq(sh.shard_group:size(), world, "full_shard: the shard group is the world")
t.raises(function() fsdp.shard(nn.Linear(3, 5), { stratgy = "full_shard" }) end,
  { "fsdp.shard: unknown option 'stratgy'", "did you mean 'strategy'?" }, "a misspelled fsdp.shard option")
t.raises(function() fsdp.shard(nn.Linear(3, 5), { mixed_precision = { compte = "bf16" } }) end,
  { "mixed_precision: unknown option 'compte'", "did you mean 'compute'?" }, "a misspelled mixed_precision key")
local optim = require "fsdp.optim"
t.raises(function() optim.AdamW(sh:param_groups(0.1), { lr = 1e-3, weight_deacy = 0.1 }) end,
  { "AdamW: unknown option 'weight_deacy'", "did you mean 'weight_decay'?" }, "a misspelled AdamW option")
t.raises(function() optim.SGD(sh:parameters(), { lr = 0.1, momentun = 0.9 }) end,
  { "SGD: unknown option 'momentun'", "did you mean 'momentum'?" }, "a misspelled SGD option")
t.raises(function() optim.AdamW({ { params = {}, wd = 0.1 } }) end, { "AdamW: group 1: unknown option 'wd'" },
  "an unknown key in a parameter group")

t.done()
