-- Sharded loading: fsdp.checkpoint.import of a Hugging Face GPT-2 file
-- (Conv1D weights stored transposed, wte cut to vocab_size rows) reads on
-- each rank only the byte ranges of its own slices, straight into its
-- shard, one parameter's staging at a time. Checked against the loading
-- --init did before (GPT:from_hf on the whole file, then fsdp.shard): the
-- shards must be equal bit for bit, for several policies and strategies,
-- from an F32 and a BF16 file; and the allocator's peak while importing
-- must stay within the shard plus the largest parameter.
--   mpirun -np 3 fsdp-lua tests/distributed/test_ckpt_import.lua --dir=build/ckpt_test_import
-- --preset=small: the same on GPT-2 124M (a 475 MiB file written under
-- --dir first), printing both loadings' peaks per rank.
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local st = require "fsdp.safetensors"
local ck = require "fsdp.checkpoint"
local dist = fsdp.distributed

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local rank, world = dist.rank(), dist.world()
local small = opts.preset == "small"
-- awkward sizes: a prime vocabulary (padded in the model, cut in the file),
-- a width of 15 (3 heads of 5), rows that no rank count divides
local cfg = small and nn.gpt_preset("small") or { vocab_size = 97, n_layer = 2, n_head = 3, n_embd = 15, block_size = 7 }
if small then cfg.block_size = 64 end
local MiB = 2 ^ 20

local function barrier() dist.world_group():max(0) end

-- the files, written by rank 0: F32 as Hugging Face ships GPT-2 (no fsdp
-- metadata), and the same values in BF16
local f32_path, bf16_path = dir .. "/model.safetensors", dir .. "/model_bf16.safetensors"
if rank == 0 then
  os.execute("mkdir -p '" .. dir .. "'")
  if not (small and io.open(f32_path, "rb")) then
    local src = nn.GPT(cfg):materialize { seed = 11 }
    local hf = src:to_hf()
    st.save(f32_path, hf)
    if not small then
      local half = {}
      for k, v in pairs(hf) do half[k] = v:bf16() end
      st.save(bf16_path, half)
    end
  end
end
barrier()

local function largest_param_bytes(model)
  local n = 0
  for _, p in ipairs(model:named_parameters()) do
    local k = 1
    for _, s in ipairs(p.shape) do k = k * s end
    n = math.max(n, 4 * k)
  end
  return n
end

local function mem() return fsdp.memory.stats(nil, "cpu") end

-- Loads path into a fresh sharded model, as --init did before (whole file,
-- GPT:from_hf, then fsdp.shard) or by import; returns the sharded model
-- and the load's peak above what was allocated before it, and the bytes
-- held after it (the shard).
local function load(how, path, so)
  collectgarbage()
  collectgarbage()
  local base = mem().current
  fsdp.memory.reset_peak("cpu")
  local model = nn.GPT(cfg)
  local sh, before_import
  if how == "from_hf" then
    model:from_hf(st.load(path))
    sh = fsdp.shard(model, so)
  else
    sh = fsdp.shard(model, so)
    collectgarbage()
    before_import = mem().current
    fsdp.memory.reset_peak("cpu")
    ck.import(path, sh, { progress = false })
  end
  local now = mem()
  local r = { sh = sh, model = model, peak = now.peak - base, held = now.current - base }
  if before_import then r.import_peak = now.peak - before_import end
  return r
end

-- every shard slice of a and b, bit for bit
local function same_shards(a, b, what)
  local bad, first = 0, nil
  t.eq(#a.sh.units, #b.sh.units, what .. ": as many units")
  for k, u in ipairs(a.sh.units) do
    local x, y = u.master:tolist(), b.sh.units[k].master:tolist()
    if #x ~= #y then
      bad, first = bad + 1, first or u.name
    else
      for i = 1, #x do
        if x[i] ~= y[i] then
          bad = bad + 1
          first = first or string.format("%s element %d: %.9g vs %.9g", u.name, i - 1, x[i], y[i])
        end
      end
    end
  end
  t.ok(bad == 0, string.format("rank %d: %s: the imported shards equal --init's from_hf + fsdp.shard bit for bit%s",
    rank, what, first and (" (" .. bad .. " differ, first " .. first .. ")") or ""))
end

local policies = {
  block = fsdp.policy.per_block(), none = fsdp.policy.none(), size = fsdp.policy.by_size(small and 1e6 or 300),
}
local cases = { { policy = "block" } }
if not small then
  cases[#cases + 1] = { policy = "none" }
  cases[#cases + 1] = { policy = "size", compute = "bf16" }
  cases[#cases + 1] = { policy = "block", strategy = "no_shard" }
  if world % 2 == 0 then cases[#cases + 1] = { policy = "size", strategy = "hybrid_shard", group_size = 2 } end
end

local files = small and { { f32_path, "F32" } } or { { f32_path, "F32" }, { bf16_path, "BF16" } }
for _, f in ipairs(files) do
  for _, c in ipairs(cases) do
    local so = { policy = policies[c.policy], strategy = c.strategy, group_size = c.group_size, seed = 5,
      mixed_precision = { compute = c.compute or "f32" } }
    local what = string.format("%s file, policy %s, %s%s", f[2], c.policy, c.strategy or "full_shard",
      c.compute and (", compute " .. c.compute) or "")
    local ref = load("from_hf", f[1], so)
    local new = load("import", f[1], so)
    same_shards(ref, new, what)
    local big = largest_param_bytes(new.model)
    -- (an F32 file stages at most one parameter's f32 slice; a BF16 one
    -- its bf16 slice and the f32 widening of it)
    local stage_bound = f[2] == "F32" and big or 1.5 * big
    t.ok(new.import_peak <= stage_bound,
      string.format("rank %d: %s: import stages %d bytes at most, within the largest parameter's %d", rank, what,
        new.import_peak, stage_bound))
    t.ok(new.peak <= new.held + stage_bound,
      string.format("rank %d: %s: the load peaks at %.3f MiB, within the shard (%.3f MiB) plus the largest "
        .. "parameter (%.3f MiB)", rank, what, new.peak / MiB, new.held / MiB, stage_bound / MiB))
    if c == cases[1] then
      local peaks = dist.world_group():max({ ref.peak, new.peak, new.held, new.import_peak })
      local u, s = small and "MiB" or "KiB", small and MiB or 1024
      dist.print0("%s, %d rank(s): load peak per rank (max over ranks) %.1f %s by from_hf + fsdp.shard, %.1f %s "
        .. "by import (shard %.1f %s, import staging %.1f %s; largest parameter %.1f %s)", what, world,
        peaks[1] / s, u, peaks[2] / s, u, peaks[3] / s, u, peaks[4] / s, u, big / s, u)
    end
    ref.sh, new.sh = nil, nil
  end
end

-- a file whose tensor is another dtype is refused before anything is read
if not small then
  local bad_path = dir .. "/model_i32.safetensors"
  if rank == 0 then
    local hf = nn.GPT(cfg):materialize { seed = 11 }:to_hf()
    hf["h.0.ln_1.bias"] = fsdp.zeros({ cfg.n_embd }, { dtype = "i32" })
    st.save(bad_path, hf)
  end
  barrier()
  local sh = fsdp.shard(nn.GPT(cfg), { policy = policies.block, seed = 5 })
  t.raises(function() ck.import(bad_path, sh, { progress = false }) end,
    { "model_i32.safetensors", '"h.0.ln_1.bias"', "I32", "F32 and BF16" }, "a tensor of another dtype")
end
t.done()
