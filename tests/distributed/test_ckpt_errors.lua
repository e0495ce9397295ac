-- Damaged or mismatched checkpoints fail on every rank with an error naming
-- the file and the parameter, and leave the model and optimizer as they were:
-- a flipped byte, a truncated file, a missing shard file, an index from
-- another model, a shape that differs, an index that is not JSON, another
-- optimizer type; an edited index (a range's offset moved by 64, two ranges
-- made to overlap: refused by the index checksum, and, with the index
-- re-sealed as a forger would, by the tiling and blob checks).
--   mpirun -np 2 fsdp-lua tests/distributed/test_ckpt_errors.lua --dir=build/ckpt_test_errors
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local json = require "fsdp.json"
local ck = require "fsdp.checkpoint"
local format = require "fsdp.checkpoint.format"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local rank = fsdp.rank()

local model, sh, opt = common.sharded { policy = "block" }
if rank == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
common.barrier(sh)
local loader = common.loader(4)
for _ = 1, 2 do common.step(model, sh, opt, loader) end
local good = dir .. "/good"
ck.save(good, { model = sh, optim = opt, step = 2 })

-- another model's checkpoint, for its index
do
  local other = nn.Llama { vocab_size = 256, n_layer = 1, n_head = 2, n_embd = 16, block_size = 8 }
  local osh = fsdp.shard(other, { policy = fsdp.policy.per_block(), seed = 3 })
  ck.save(dir .. "/other", { model = osh, step = 1 })
end

-- then train on, so that memory differs from the checkpoint
for _ = 1, 2 do common.step(model, sh, opt, loader) end

local function snapshot()
  local s = { params = {}, state = {}, step_count = opt.step_count }
  for path, v in pairs(sh:full_state_dict()) do s.params[path] = v:view(-1):tolist() end
  for i, seg in ipairs(sh.segments) do
    local st = opt.state[seg.tensor]
    s.state[i] = { st.exp_avg, st.exp_avg:tolist(), st.exp_avg_sq:tolist(), st.step }
  end
  return s
end

local function unchanged(before, name)
  local now = snapshot()
  local bad = 0
  for path, v in pairs(before.params) do
    local w = now.params[path]
    for i = 1, #v do if v[i] ~= w[i] then bad = bad + 1 end end
  end
  for i, seg in ipairs(sh.segments) do
    local st, b = opt.state[seg.tensor], before.state[i]
    if st.exp_avg ~= b[1] or st.step ~= b[4] then bad = bad + 1 end
    local ea, eb = st.exp_avg:tolist(), st.exp_avg_sq:tolist()
    for j = 1, #ea do
      if ea[j] ~= b[2][j] or eb[j] ~= b[3][j] then bad = bad + 1 end
    end
  end
  if now.step_count ~= before.step_count then bad = bad + 1 end
  t.eq(bad, 0, name .. ": parameters and optimizer state unchanged after the failed load")
end

-- rank 0 prepares a damaged copy of the good checkpoint; fn(copy) edits it
local function damaged(name, fn)
  local copy = dir .. "/" .. name
  if rank == 0 then
    os.execute(string.format("rm -rf '%s' && cp -r '%s' '%s'", copy, good, copy))
    fn(copy)
  end
  common.barrier(sh)
  return copy
end

local function read_all(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function write_all(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local index = ck.read_index(good)
local target   -- a parameter range in rank_00001.bin
for _, p in ipairs(index.params) do
  for _, r in ipairs(p.ranges) do
    if r.file == "rank_00001.bin" and r.count > 100 and p.path:match("^h%.1%.") then target = { p.path, r } end
  end
end
assert(target, "no parameter range in rank_00001.bin")

local cases = {
  { "flipped", function(c)
      local path = c .. "/rank_00001.bin"
      local s = read_all(path)
      local at = target[2].offset + 40 + 1
      write_all(path, s:sub(1, at - 1) .. string.char(bit.bxor(s:byte(at), 0x10)) .. s:sub(at + 1))
    end, { "rank_00001.bin", "checksum mismatch", target[1] } },
  { "truncated", function(c)
      local path = c .. "/rank_00000.bin"
      local s = read_all(path)
      write_all(path, s:sub(1, math.floor(#s / 2)))
    end, { "rank_00000.bin", "truncated", "parameter 'wte.weight'" } },
  { "missing", function(c) os.remove(c .. "/rank_00001.bin") end,
    { "rank_00001.bin", "cannot open", "parameter '" } },
  { "other_model", function(c)
      write_all(c .. "/index.json", read_all(dir .. "/other/index.json"))
    end, { "index.json", "'wpe.weight' is not in the checkpoint" } },
  { "shape", function(c)
      local idx = json.decode(read_all(c .. "/index.json"))
      for _, p in ipairs(idx.params) do
        if p.path == "h.0.mlp.c_fc.weight" then p.shape = json.array({ p.shape[2], p.shape[1] }) end
      end
      write_all(c .. "/index.json", format.encode_index(idx))   -- re-sealed: a checkpoint of another shape
    end, { "index.json", "'h.0.mlp.c_fc.weight' has shape (16, 64)", "expects (64, 16)" } },
  { "not_json", function(c)
      write_all(c .. "/index.json", read_all(c .. "/index.json"):sub(1, 100))
    end, { "index.json", "not valid JSON" } },
  -- the index edited in place (its checksum no longer matches)
  { "offset_edit", function(c)
      local text = read_all(c .. "/index.json")
      local off = target[2].offset
      local edited, n = text:gsub('"offset": ' .. off .. ',', '"offset": ' .. (off + 64) .. ',', 1)
      assert(n == 1)
      write_all(c .. "/index.json", edited)
    end, { "index.json", "checksum does not match", "edited or damaged", "in the entry of parameter '" } },
  { "whitespace_edit", function(c)
      write_all(c .. "/index.json", (read_all(c .. "/index.json"):gsub("\n ", "\n  ", 1)))
    end, { "index.json", "checksum does not match", "outside the parameter entries" } },
  -- forged: edited and re-sealed; the structure and the blob checksums still catch it
  { "offset_resealed", function(c)
      local idx = json.decode(read_all(c .. "/index.json"))
      for _, p in ipairs(idx.params) do
        for _, r in ipairs(p.ranges) do
          if p.path == target[1] and r.file == "rank_00001.bin" then r.offset = r.offset + 64 end
        end
      end
      write_all(c .. "/index.json", format.encode_index(idx))
    end, { "index.json", "rank_00001.bin", "belong to no tensor", target[1] } },
  { "overlap_resealed", function(c)
      local idx = json.decode(read_all(c .. "/index.json"))
      for _, p in ipairs(idx.params) do
        if p.path == "wte.weight" then p.ranges[2].start = p.ranges[2].start - 128 end
      end
      write_all(c .. "/index.json", format.encode_index(idx))
    end, { "index.json", "parameter 'wte.weight'", "in two files" } },
  { "swap_resealed", function(c)   -- two blobs of one size trade places: only their checksums tell
      local idx = json.decode(read_all(c .. "/index.json"))
      local a, b
      for _, p in ipairs(idx.params) do
        for _, r in ipairs(p.ranges) do
          if r.file == "rank_00000.bin" and p.path:match("ln_1%.weight$") then
            if not a then a = r elseif not b then b = r end
          end
        end
      end
      a.offset, b.offset = b.offset, a.offset
      write_all(c .. "/index.json", format.encode_index(idx))
    end, { "rank_00000.bin", "checksum mismatch", "ln_1.weight" } },
}

for _, case in ipairs(cases) do
  local name, edit, needles = case[1], case[2], case[3]
  local copy = damaged(name, edit)
  local before = snapshot()
  t.raises(function() ck.load(copy, { model = sh, optim = opt }) end, needles, name .. ": load fails clearly")
  unchanged(before, name)
end

-- the wrong optimizer type
do
  local sgd = optim.SGD(sh:param_groups(0.1), { lr = 0.1, momentum = 0.9 })
  local before = snapshot()
  t.raises(function() ck.load(good, { model = sh, optim = sgd }) end, { "optimizer is AdamW", "this one is SGD" },
    "SGD from an AdamW checkpoint")
  unchanged(before, "wrong optimizer")
end
-- a checkpoint without optimizer state, asked for one
do
  local before = snapshot()
  local _, osh = common.sharded { policy = "size" }
  ck.save(dir .. "/no_optim", { model = osh, step = 1 })
  t.raises(function() ck.load(dir .. "/no_optim", { model = sh, optim = opt }) end, { "no optimizer state" },
    "optimizer state asked of a checkpoint without it")
  unchanged(before, "no optimizer state")
end
t.raises(function() ck.load(dir .. "/absent", { model = sh }) end, { "absent", "no such checkpoint" },
  "a directory that does not exist")

-- saves that cannot happen fail alike on every rank and leave nothing behind
t.raises(function() ck.save("/proc/no_such_place/ckpt", { model = sh, optim = opt }) end,
  { "cannot create directory", "/proc/no_such_place" }, "save into a place that cannot be written")
t.raises(function() ck.save(dir .. "/bad_extra", { model = sh, extra = { f = print } }) end,
  { "state.extra cannot be stored as JSON" }, "save with extra that JSON cannot hold")
t.ok(not io.open(dir .. "/bad_extra.tmp/index.json"), "a failed save leaves no index")

-- the good one still loads, and the values are back at step 2's
local info = ck.load(good, { model = sh, optim = opt })
t.eq(info.step, 2, "the undamaged checkpoint loads after all that")
if rank == 0 then print("errors: every damaged checkpoint was refused") end
t.done()
