-- Full export and import: a sharded GPT written as one safetensors file with
-- Hugging Face GPT-2 names and layouts (Conv1D weights transposed, wte cut
-- to vocab_size rows), unit by unit; read back into sharded models of
-- another policy and into an unsharded module. Also writes input ids and the
-- engine's logits, which tools/dev/check_export.py compares with PyTorch.
--   mpirun -np 2 fsdp-lua tests/distributed/test_ckpt_export.lua --dir=build/ckpt_test_export
package.path = "tests/lua/?.lua;tests/distributed/?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local st = require "fsdp.safetensors"
local ck = require "fsdp.checkpoint"
local common = require "ckpt_common"

local opts = ... or {}
local dir = assert(opts.dir, "--dir=DIR is required")
local rank = fsdp.rank()
-- vocab 96 pads to 128: the export must cut wte
local cfg = { vocab_size = 96, n_layer = 2, n_head = 2, n_embd = 16, block_size = 8 }
local B, T = 4, 8

local function batch(step) return t.token_batch(step * 7919 + 17, B, T, cfg.vocab_size) end

-- (--offload: the exported model keeps its shards on the CPU)
local model, sh, opt = common.sharded { cfg = cfg, policy = "block", seed = 3, offload = opts.offload == true }
if rank == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
common.barrier(sh)
-- train a little (on each rank's rows), so the values are not the init's
for step = 1, 3 do
  local x, y = batch(step)
  local w, r = fsdp.world(), rank
  local rows = B / w
  local _, loss = model(x:narrow(1, r * rows + 1, rows):contiguous(), y:narrow(1, r * rows + 1, rows):contiguous())
  loss:backward()
  opt:step()
  sh:zero_grad()
end

local hf_path, native_path = dir .. "/model.safetensors", dir .. "/native.safetensors"
ck.export(hf_path, sh, { hf = true })
ck.export(native_path, sh)
local full = sh:full_state_dict()

local ids = batch(99)
local logits = fsdp.no_grad(function()
  model:eval()
  local l = model(ids)
  model:train()
  return l
end)
if rank == 0 then
  st.save(dir .. "/logits.safetensors", { input_ids = ids, logits = logits:contiguous() },
    { vocab_size = cfg.vocab_size })
end
common.barrier(sh)

-- the file: HF names, shapes and layouts
local hf = st.load(hf_path)
local info = st.read_header(hf_path)
t.eq(#info.names, #model:named_parameters(), "one tensor per parameter")
t.eq(info.metadata.fsdp_layout, "hf", "metadata says hf")
t.eq(info.metadata.n_layer, "2", "metadata carries the config")
local expect = {}
for path, v in pairs(full) do
  if path:match("^h%.%d+%..*c_%a+%.weight$") then
    expect[path] = v:transpose(1, 2):contiguous()
  elseif path == "wte.weight" then
    expect[path] = v:narrow(1, 1, cfg.vocab_size):contiguous()
  else
    expect[path] = v
  end
end
local bad, first = 0, nil
for name, want in pairs(expect) do
  local got = hf[name]
  if not got then
    bad = bad + 1
    first = first or ("missing " .. name)
  else
    local a, b = got:view(-1):tolist(), want:contiguous():view(-1):tolist()
    local same = #a == #b and table.concat(got:shape(), "x") == table.concat(want:shape(), "x")
    for i = 1, #b do same = same and a[i] == b[i] end
    if not same then
      bad = bad + 1
      first = first or name
    end
  end
end
t.ok(bad == 0, "the HF export holds every tensor, transposed and cut as to_hf does" ..
  (first and (" (first wrong: " .. first .. ")") or ""))
t.eq(table.concat(hf["h.0.attn.c_attn.weight"]:shape(), "x"), "16x48", "Conv1D weight stored (in, out)")
t.eq(table.concat(hf["wte.weight"]:shape(), "x"), "96x16", "wte cut to vocab_size rows")

local function compare(sd, what, skip_pad)
  local n, f = 0, nil
  for path, want in pairs(full) do
    local g, w = sd[path], want
    if skip_pad and path == "wte.weight" then
      local pad = g:narrow(1, cfg.vocab_size + 1, g:shape()[1] - cfg.vocab_size):view(-1):tolist()
      for _, v in ipairs(pad) do if v ~= 0 then n = n + 1 end end
      g, w = g:narrow(1, 1, cfg.vocab_size), w:narrow(1, 1, cfg.vocab_size)
    end
    local a, b = g:contiguous():view(-1):tolist(), w:contiguous():view(-1):tolist()
    for i = 1, #b do
      if a[i] ~= b[i] then
        n = n + 1
        f = f or path
      end
    end
  end
  t.ok(n == 0, what .. (f and (" (first wrong: " .. f .. ")") or ""))
end

-- import into sharded models of other policies
for _, policy in ipairs({ "none", "size" }) do
  local m2, sh2 = common.sharded { cfg = cfg, policy = policy, seed = 77 }
  ck.import(hf_path, sh2)
  compare(sh2:full_state_dict(), "HF import into a sharded model (policy " .. policy .. ") equals the export "
    .. "(padding rows zero)", true)
  local l2 = fsdp.no_grad(function()
    m2:eval()
    return m2(ids)
  end)
  local a, b = l2:narrow(3, 1, cfg.vocab_size):contiguous():view(-1):tolist(),
      logits:narrow(3, 1, cfg.vocab_size):contiguous():view(-1):tolist()
  local worst = 0
  for i = 1, #b do worst = math.max(worst, math.abs(a[i] - b[i])) end
  t.ok(worst <= 1e-6, string.format("logits of the imported model (policy %s) match: max diff %.3g", policy, worst))
  local _, sh3 = common.sharded { cfg = cfg, policy = policy, seed = 78 }
  ck.import(native_path, sh3)
  compare(sh3:full_state_dict(), "native export/import round trip (policy " .. policy .. ") is exact")
end
-- replicated strategies: the first replica group alone gathers and writes
for _, v in ipairs({ { strategy = "no_shard" }, { strategy = "hybrid_shard", group_size = fsdp.world() / 2 } }) do
  if v.strategy == "no_shard" or fsdp.world() % 2 == 0 then
    local _, shr = common.sharded { cfg = cfg, policy = "block", seed = 79, strategy = v.strategy,
      group_size = v.group_size }
    ck.import(native_path, shr)
    local again = string.format("%s/again_%s.safetensors", dir, v.strategy)
    ck.export(again, shr)
    local same = true
    if rank == 0 then same = io.open(native_path, "rb"):read("*a") == io.open(again, "rb"):read("*a") end
    t.ok(same, v.strategy .. ": import then export gives the same file")
  end
end
-- into an unsharded module
local plain = nn.GPT(cfg):materialize { seed = 5 }
ck.import(hf_path, plain)
compare(plain:state_dict(), "HF import into an unsharded module", true)
-- an unsharded module exports the same file
if fsdp.world() == 1 then
  local p2 = nn.GPT(cfg):materialize { seed = 6 }
  ck.import(native_path, p2)
  ck.export(dir .. "/plain.safetensors", p2, { hf = true })
  local a = io.open(hf_path, "rb"):read("*a")
  local b = io.open(dir .. "/plain.safetensors", "rb"):read("*a")
  t.ok(a == b, "an unsharded module exports the same bytes")
end
-- errors name the file and the tensor
local wrong = nn.GPT { vocab_size = 96, n_layer = 2, n_head = 2, n_embd = 32, block_size = 8 }
local wsh = fsdp.shard(wrong, { seed = 1 })
t.raises(function() ck.import(hf_path, wsh) end, { "model.safetensors", "'h.0.attn.c_attn.bias'", "has shape (48)", "needs (96)" },
  "import into a model of another width")
if rank == 0 then print("export: HF and native files written and read back on " .. fsdp.world() .. " rank(s)") end
t.done()
