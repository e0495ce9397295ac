-- Shared pieces of the checkpoint tests (tests/distributed/test_ckpt_*.lua): a tiny
-- GPT, sharded or not, trained on byte batches of data/corpus.txt; dumps of
-- what a rank holds, written with plain safetensors (independent of the
-- checkpoint code) and assembled back into full tensors.
local ffi = require "ffi"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local data = require "fsdp.data"
local st = require "fsdp.safetensors"
local json = require "fsdp.json"

local M = {}

M.cfg = { vocab_size = 256, n_layer = 2, n_head = 2, n_embd = 16, block_size = 8 }
M.B, M.T = 12, 8

M.policies = {
  block = function() return fsdp.policy.per_block() end,
  size = function() return fsdp.policy.by_size(1000) end,
  none = function() return fsdp.policy.none() end,
  custom = function() return function(m, path) return path == "h.1" or m.__name == "MLP" end end,
}

--- A sharded tiny GPT (opts: policy, strategy, group_size, seed, cfg, offload) and
-- its AdamW (or SGD with opts.sgd).
function M.sharded(opts)
  opts = opts or {}
  local model = nn.GPT(opts.cfg or M.cfg)
  local sh = fsdp.shard(model, {
    policy = M.policies[opts.policy or "block"](), strategy = opts.strategy or "full_shard",
    group_size = opts.group_size, seed = opts.seed or 7, offload = opts.offload,
  })
  local opt
  if opts.sgd then
    opt = optim.SGD(sh:param_groups(0.1), { lr = 1e-2, momentum = 0.9 })
  else
    opt = optim.AdamW(sh:param_groups(0.1), { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8 })
  end
  return model, sh, opt
end

--- An unsharded (materialized) tiny GPT and its AdamW.
function M.plain(opts)
  opts = opts or {}
  local model = nn.GPT(opts.cfg or M.cfg):materialize { seed = opts.seed or 7 }
  local opt = optim.AdamW(optim.decay_groups(model:named_parameters(), 0.1),
    { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8 })
  return model, opt
end

--- A byte loader over the corpus giving this rank its rows of each batch.
function M.loader(seed)
  return data.ByteLoader { path = "data/corpus.txt", batch = M.B, ctx = M.T, seed = seed or 1, shuffle = true,
    rank = fsdp.rank(), world = fsdp.world() }
end

local function mean_over(sh, v) return sh.group:mean(v) end

--- One training step: forward, backward, clip, AdamW, zero; the global mean loss.
function M.step(model, sh, opt, loader, lr)
  local x, y = loader:next()
  opt:set_lr(lr or 3e-3)
  local _, loss = model(x, y)
  loss:backward()
  sh:clip_grad_norm(1.0)
  opt:step()
  sh:zero_grad()
  return mean_over(sh, loss:item())
end

function M.barrier(sh)
  sh.group:barrier()
end

--- Each rank writes what it holds: "param|path|start", "exp_avg|path|start",
-- ... for each of its slices (plain safetensors, one file per rank).
function M.dump_slices(sh, opt, path)
  local tensors = {}
  local k = 0
  for _, u in ipairs(sh.units) do
    local lo, hi = u.shard_offset, u.shard_offset + u.shard_numel
    for i, p in ipairs(u.params) do
      local off = u.offsets[i]
      local a, b = math.max(lo, off), math.min(hi, off + p.numel)
      if a < b then
        k = k + 1
        local s = sh.segments[k]
        local key = "|" .. p.path .. "|" .. (a - off)
        tensors["param" .. key] = s.tensor:clone()
        local state = opt and opt.state[s.tensor]
        if state then
          for _, nm in ipairs({ "exp_avg", "exp_avg_sq", "buf" }) do
            if state[nm] then tensors[nm .. key] = state[nm]:clone() end
          end
          tensors["step" .. key] = fsdp.tensor({ state.step or 0 }, { dtype = "i64" })
        end
      end
    end
  end
  st.save(path, tensors, { step_count = opt and opt.step_count or 0 })
end

--- All dumps in dir matching prefix*, assembled: { kind = { path = {values (Lua, 1-based)} } }, steps {path = n}.
function M.assemble(files)
  local full, steps, count = {}, {}, nil
  for _, f in ipairs(files) do
    local tensors, meta = st.load(f)
    count = tonumber(meta.step_count)
    for name, t in pairs(tensors) do
      local kind, path, start = name:match("^([^|]+)|([^|]+)|(%d+)$")
      start = tonumber(start)
      if kind == "step" then
        steps[path] = t:tolist()[1]
      else
        full[kind] = full[kind] or {}
        full[kind][path] = full[kind][path] or {}
        local dst = full[kind][path]
        for i, v in ipairs(t:tolist()) do dst[start + i] = v end
      end
    end
  end
  return full, steps, count
end

--- Compares this rank's slices (parameters and optimizer state) with the
-- assembled reference. Returns the number of mismatching elements and a
-- description of the first.
function M.compare_slices(sh, opt, ref, names)
  local bad, first = 0, nil
  local k = 0
  for _, u in ipairs(sh.units) do
    local lo, hi = u.shard_offset, u.shard_offset + u.shard_numel
    for i, p in ipairs(u.params) do
      local off = u.offsets[i]
      local a, b = math.max(lo, off), math.min(hi, off + p.numel)
      if a < b then
        k = k + 1
        local s = sh.segments[k]
        local function check(kind, t)
          local want = ref[kind] and ref[kind][p.path]
          if not t or not want then
            bad = bad + 1
            first = first or (kind .. " of " .. p.path .. " missing")
            return
          end
          local got = t:view(-1):tolist()
          for j = 1, #got do
            if got[j] ~= want[a - off + j] then
              bad = bad + 1
              first = first or string.format("%s of %s element %d: %.9g vs %.9g", kind, p.path, a - off + j - 1,
                got[j], want[a - off + j])
            end
          end
        end
        check("param", s.tensor)
        for _, nm in ipairs(names or {}) do
          local state = opt.state[s.tensor]
          check(nm, state and state[nm])
        end
      end
    end
  end
  return bad, first
end

--- Compares a {path = tensor} dict of full tensors with the reference
-- parameters, exactly. rows: compare only the first `rows` rows of wte.
function M.compare_full(sd, ref, vocab_rows)
  local bad, first = 0, nil
  for path, want in pairs(ref.param) do
    local t = sd[path]
    if path == "wte.weight" and vocab_rows then t = t:narrow(1, 1, vocab_rows) end
    local got = t:contiguous():view(-1):tolist()
    for j = 1, #got do
      if got[j] ~= want[j] then
        bad = bad + 1
        first = first or string.format("%s element %d: %.9g vs %.9g", path, j - 1, got[j], want[j])
      end
    end
  end
  return bad, first
end

function M.write_json(path, v)
  local f = assert(io.open(path, "w"))
  f:write(json.encode(v))
  f:close()
end

function M.read_json(path)
  local f = assert(io.open(path, "r"))
  local v = json.decode(f:read("*a"))
  f:close()
  return v
end

function M.glob(pattern) return data.glob(pattern) end

return M
