-- Tests for fsdp.checkpoint on one rank (the multi-rank ones are in
-- tests/distributed/test_ckpt_*.lua): a save and load of an nn module and
-- its AdamW state round-trips bit for bit; progress reports rise to their
-- totals; the checksums are XXH64 of the bytes on disk (an independent
-- check through fsdp.io); a damaged checkpoint is refused with the file and
-- the parameter named, and leaves the model as it was.

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local json = require "fsdp.json"
local fio = require "fsdp.io"
local ck = require "fsdp.checkpoint"

local tmp = os.tmpname()
os.remove(tmp)
fio.mkdirs(tmp)
local function P(name) return tmp .. "/" .. name end

-- odd sizes: 37 (vocab), 9 (context), 12 (width), 3 heads
local cfg = { vocab_size = 37, n_layer = 2, n_head = 3, n_embd = 12, block_size = 9 }

local function model_and_opt(seed)
  local m = nn.GPT(cfg):materialize { seed = seed }
  local o = optim.AdamW(optim.decay_groups(m:named_parameters(), 0.1), { lr = 1e-2 })
  return m, o
end

-- every parameter and AdamW moment as Lua numbers
local function state_of(m, o)
  local s = {}
  for _, p in ipairs(m:named_parameters()) do
    s[p.path] = p.tensor:view(-1):tolist()
    local st = o.state[p.tensor]
    if st then
      s[p.path .. "#m"] = st.exp_avg:view(-1):tolist()
      s[p.path .. "#v"] = st.exp_avg_sq:view(-1):tolist()
      s[p.path .. "#step"] = { st.step }
    end
  end
  s["#step_count"] = { o.step_count }
  return s
end

local function differences(a, b)
  local n = 0
  for k, v in pairs(a) do
    local w = b[k]
    if not w or #w ~= #v then
      n = n + 1
    else
      for i = 1, #v do if v[i] ~= w[i] then n = n + 1 end end
    end
  end
  for k in pairs(b) do if not a[k] then n = n + 1 end end
  return n
end

local function train(m, o, steps)
  for s = 1, steps do
    local x = t.token_batch(s * 31 + 7, 2, cfg.block_size, cfg.vocab_size)
    local y = t.token_batch(s * 31 + 8, 2, cfg.block_size, cfg.vocab_size)
    local _, loss = m(x, y)
    loss:backward()
    o:step()
    o:zero_grad()
  end
end

local m, o = model_and_opt(5)
train(m, o, 2)
local saved = state_of(m, o)

-- ---- round trip, progress ----
local events = {}
local dir = P("good")
ck.save(dir, { model = m, optim = o, step = 2, extra = { note = "x" } },
  { progress = function(op, done, total) events[#events + 1] = { op, done, total } end })
local rising, last = true, 0
for _, e in ipairs(events) do
  if e[1] ~= "save" or e[2] < last or e[2] > e[3] then rising = false end
  last = e[2]
end
t.ok(#events == #m:named_parameters() * 3 and rising and last == events[#events][3] and last > 0,
  "save progress: one report per blob, rising to the total")

local m2, o2 = model_and_opt(99)
train(m2, o2, 1)
t.ok(differences(state_of(m2, o2), saved) > 0, "a fresh model differs before the load")
local lev = {}
local info = ck.load(dir, { model = m2, optim = o2 },
  { progress = function(op, done, total) lev[#lev + 1] = { op, done, total } end })
t.eq(info.step, 2, "load returns the step")
t.eq(info.extra.note, "x", "load returns extra")
t.eq(differences(state_of(m2, o2), saved), 0, "load restores parameters and AdamW state bit for bit")
t.ok(#lev > 0 and lev[#lev][1] == "load" and lev[#lev][2] == lev[#lev][3], "load progress reaches its total")
t.raises(function() ck.save(P("p"), { model = m }, { progress = 5 }) end, { "progress must be a function" },
  "progress that is not a function")

-- ---- checksums are XXH64 of the bytes on disk ----
local index = ck.read_index(dir)
t.eq(index.checksum.algorithm, "xxh64", "checksum algorithm")
do
  local fe = index.files[1]
  local bytes = fio.read_file(dir .. "/" .. fe.name)
  t.eq(#bytes, fe.bytes, "file size as indexed")
  -- every blob, in file order: its XXH64, and the file's checksum from those
  local blobs = {}
  local function add(ranges) for _, r in ipairs(ranges) do blobs[#blobs + 1] = r end end
  for _, p in ipairs(index.params) do add(p.ranges) end
  for _, e in ipairs(index.optimizer.params) do add(e.exp_avg); add(e.exp_avg_sq) end
  table.sort(blobs, function(a, b) return a.offset < b.offset end)
  local bad, hexes = 0, {}
  for i, r in ipairs(blobs) do
    local padded = 64 * math.ceil(4 * r.count / 64)
    if fio.hash_string(bytes:sub(r.offset + 1, r.offset + padded)) ~= r.checksum then bad = bad + 1 end
    hexes[i] = r.checksum
  end
  t.eq(bad, 0, "every blob's checksum is XXH64 of its padded extent on disk")
  t.eq(fio.hash_string(table.concat(hexes) .. tostring(#bytes)), fe.checksum,
    "the file's checksum: XXH64 of its blobs' checksums and its size")
end

-- ---- damage is refused, the model stays as it was ----
local function copy_dir(src, dst)
  fio.remove_tree(dst)
  fio.mkdirs(dst)
  for _, n in ipairs(fio.list_dir(src)) do fio.write_atomic(dst .. "/" .. n, fio.read_file(src .. "/" .. n)) end
end

local m3, o3 = model_and_opt(7)
train(m3, o3, 1)
local before = state_of(m3, o3)
do
  local c = P("flip")
  copy_dir(dir, c)
  local r = index.params[3].ranges[1]
  local path = c .. "/" .. r.file
  local s = fio.read_file(path)
  local at = r.offset + 5
  fio.write_atomic(path, s:sub(1, at) .. string.char(bit.bxor(s:byte(at + 1), 1)) .. s:sub(at + 2))
  t.raises(function() ck.load(c, { model = m3, optim = o3 }) end,
    { r.file, "checksum mismatch", index.params[3].path }, "a flipped bit names the file and the parameter")
  t.eq(differences(state_of(m3, o3), before), 0, "the failed load left the model and optimizer as they were")
end

fio.remove_tree(tmp)
t.done()
