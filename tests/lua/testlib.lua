-- testlib: a tiny assertion helper for the Lua tests. Counts checks, keeps
-- going after a failure, prints "N passed, N failed" and exits 1 on failure.
--
--   local t = require "testlib"
--   t.eq(1 + 1, 2, "sum")
--   t.near(x, 0.5, 1e-6, "value")
--   local err = t.raises(function() ... end, {"fsdp_matmul", "3 vs 4"}, "matmul shapes")
--   t.no_error(function() opt:step() end, "a step over an empty group")
--   t.rel_err(a, b)                       -- ||a - b|| / ||b|| of two tensors
--   t.max_abs_diff(a, b)                  -- largest |a[i][j] - b[i][j]| of two lists of lists
--   local model, cfg = t.gpt2_tiny_fixture()   -- the PyTorch fixtures' GPT, their init weights loaded
--   t.done()
--
-- A file that made no check at all fails in done(): a test that checks
-- nothing is a mistake, not a pass.

local M = { passed = 0, failed = 0 }

local function where()
  local info = debug.getinfo(3, "Sl")
  return info and (info.short_src .. ":" .. info.currentline) or "?"
end

local function record(ok, name, detail)
  if ok then
    M.passed = M.passed + 1
  else
    M.failed = M.failed + 1
    io.stderr:write("FAIL ", where(), ": ", name or "check", detail and ("\n     " .. detail) or "", "\n")
  end
  return ok
end
M.record = record

function M.ok(cond, name) return record(cond and true or false, name) end

function M.eq(got, want, name)
  return record(got == want, name, "got " .. tostring(got) .. ", want " .. tostring(want))
end

function M.near(got, want, tol, name)
  tol = tol or 1e-5
  local ok = type(got) == "number" and math.abs(got - want) <= tol * math.max(1, math.abs(want))
  return record(ok, name, "got " .. tostring(got) .. ", want " .. tostring(want) .. " (tol " .. tol .. ")")
end

-- Nested tables of numbers, elementwise within tol.
local function close(a, b, tol)
  if type(a) == "number" and type(b) == "number" then
    return math.abs(a - b) <= tol * math.max(1, math.abs(b))
  end
  if type(a) ~= "table" or type(b) ~= "table" or #a ~= #b then return false end
  for i = 1, #a do
    if not close(a[i], b[i], tol) then return false end
  end
  return true
end

local function show(v)
  if type(v) ~= "table" then return tostring(v) end
  local parts = {}
  for i = 1, #v do parts[i] = show(v[i]) end
  return "{" .. table.concat(parts, ", ") .. "}"
end
M.show = show

function M.all_near(got, want, tol, name)
  return record(close(got, want, tol or 1e-5), name, "got " .. show(got) .. "\n     want " .. show(want))
end

-- fn must raise an error whose message contains every string in `needles`
-- (plain text). Returns the message.
function M.raises(fn, needles, name)
  local ok, err = pcall(fn)
  if ok then
    record(false, name, "no error raised")
    return nil
  end
  err = tostring(err)
  if type(needles) == "string" then needles = { needles } end
  for _, n in ipairs(needles or {}) do
    if not err:find(n, 1, true) then
      record(false, name, "error lacks '" .. n .. "': " .. err)
      return err
    end
  end
  record(true, name)
  return err
end

-- fn must run without raising; the error is the detail when it does not.
function M.no_error(fn, name)
  local ok, err = pcall(fn)
  return record(ok, name, not ok and ("raised: " .. tostring(err)) or nil)
end

--- A deterministic next-token batch: ids (B, T) in [0, vocab) from a
-- Lehmer generator started at seed, and targets (ids shifted by one), i64.
function M.token_batch(seed, B, T, vocab)
  local fsdp = require "fsdp"
  local rows, targets = {}, {}
  local x = seed % 2147483647
  for b = 1, B do
    rows[b], targets[b] = {}, {}
    for i = 1, T + 1 do
      x = (x * 48271) % 2147483647
      local tok = x % vocab
      if i <= T then rows[b][i] = tok end
      if i > 1 then targets[b][i - 1] = tok end
    end
  end
  return fsdp.tensor(rows, { dtype = "i64" }), fsdp.tensor(targets, { dtype = "i64" })
end

--- ||a - b|| / ||b||, the L2 relative error of two tensors (any shapes and
-- dtypes, as many elements), computed in Lua doubles; math.huge when the
-- element counts differ.
function M.rel_err(a, b)
  local x, y = a:float():contiguous():view(-1):tolist(), b:float():contiguous():view(-1):tolist()
  if #x ~= #y then return math.huge end
  local num, den = 0, 0
  for i = 1, #x do
    num = num + (x[i] - y[i]) ^ 2
    den = den + y[i] ^ 2
  end
  return math.sqrt(num / math.max(den, 1e-30))
end

--- The largest |a[i][j] - b[i][j]| of two lists of lists.
function M.max_abs_diff(a, b)
  local w = 0
  for i = 1, #a do
    for j = 1, #a[i] do w = math.max(w, math.abs(a[i][j] - b[i][j])) end
  end
  return w
end

-- One check that max |got - want| <= tol * max(|want|, 1e-6) over all
-- elements of two tensors (any device and dtype); a NaN fails it.
function M.close_scaled(got, want, tol, name)
  local function flat(x) return x:float():cpu():contiguous():view(-1):tolist() end
  local g, w, m, e = flat(got), flat(want), 0, 0
  if #g ~= #w then return M.ok(false, name .. ": sizes differ") end
  for i = 1, #w do m = math.max(m, math.abs(w[i])) end
  for i = 1, #w do
    local d = math.abs(g[i] - w[i])
    if d ~= d then d = math.huge end
    e = math.max(e, d)
  end
  return M.ok(e <= tol * math.max(m, 1e-6), string.format("%s: max err %.3g, tol %.3g x %.3g", name, e, tol, m))
end

-- A seeded randn of the given sizes on the CPU, f32 holding bf16 values
-- (exact in both dtypes).
function M.bf16_valued(seed, ...)
  local args = { ... }
  args[#args + 1] = { seed = seed, device = "cpu" }
  return require("fsdp").randn(unpack(args)):bf16():float()
end

-- fn(inputs...) on device in dtype with loss = sum(out * w): returns out
-- and the inputs' gradients.
function M.forward_backward(fn, ins, w, device, dtype)
  local xs = {}
  for i, x in ipairs(ins) do xs[i] = x:to(device):cast(dtype):detach():requires_grad(true) end
  local y = fn(unpack(xs))
  ;(y:float() * w:to(device)):sum():backward()
  local grads = {}
  for i, x in ipairs(xs) do grads[i] = x:get_grad() end
  return y, grads
end

-- Trains a sharded model for `steps` steps with the caller's optimizer:
-- batch(step) gives (x, y), each(step), when given, runs first. Returns the
-- losses (averaged over the ranks), the gradient shards of the last step
-- and the masters after it, as Lua tables.
function M.train_sharded(model, sharded, opt, batch, steps, each)
  local dist = require("fsdp").distributed
  local losses, grads = {}, {}
  for step = 1, steps do
    if each then each(step) end
    local x, y = batch(step)
    local _, loss = model(x, y)
    loss:backward()
    losses[step] = dist.mean(loss:item())
    if step == steps then
      for i, g in ipairs(sharded.grads) do grads[i] = g:tolist() end
    end
    opt:step()
    sharded:zero_grad()
  end
  local params = {}
  for i, u in ipairs(sharded.units) do params[i] = u.master:tolist() end
  return { losses = losses, grads = grads, params = params }
end

--- The tiny GPT-2 of the PyTorch fixtures (tools/dev/gpt2_torch.py) -> model,
-- cfg: an nn.GPT with the weights of tests/fixtures/gpt2_tiny_init.safetensors
-- and the config its metadata gives. Paths are from the repository root.
function M.gpt2_tiny_fixture()
  local init, meta = require("fsdp.safetensors").load("tests/fixtures/gpt2_tiny_init.safetensors")
  local cfg = {
    vocab_size = tonumber(meta.vocab_size), n_layer = tonumber(meta.n_layer), n_head = tonumber(meta.n_head),
    n_embd = tonumber(meta.n_embd), block_size = tonumber(meta.block_size),
  }
  local model = require("fsdp.nn").GPT(cfg)
  model:from_hf(init)
  return model, cfg
end

--- A GPT sharded one unit per block over every rank, and this rank's part
-- of a token batch of 2 rows per rank -> model, sharded, x, y. o: cfg (the
-- GPT's), seed (the init), data_seed, T, and optionally strategy (default
-- full_shard), mixed_precision and offload.
function M.sharded_gpt(o)
  local fsdp = require "fsdp"
  local rank, world = fsdp.rank(), fsdp.world()
  local model = require("fsdp.nn").GPT(o.cfg)
  local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), strategy = o.strategy or "full_shard",
    seed = o.seed, mixed_precision = o.mixed_precision, offload = o.offload })
  local B = 2 * world
  local x, y = M.token_batch(o.data_seed, B, o.T, o.cfg.vocab_size)
  local per = B / world
  x, y = x:narrow(1, rank * per + 1, per):contiguous(), y:narrow(1, rank * per + 1, per):contiguous()
  return model, sharded, x, y
end

--- The gradient shards of a sharded model, as Lua lists.
function M.grad_lists(sharded)
  local all = {}
  for i, g in ipairs(sharded.grads) do all[i] = g:tolist() end
  return all
end

--- How many values of two grad_lists results lie further apart than tol
-- (default 0: bit for bit).
function M.count_differ(a, b, tol)
  local n = 0
  for i = 1, #a do
    for j = 1, #a[i] do if math.abs(a[i][j] - b[i][j]) > (tol or 0) then n = n + 1 end end
  end
  return n
end

local Boom   -- a Lua op that passes its input on and fails in its backward
--- The backward of model(x, y)'s loss with a Lua op recorded before the
-- model's forward, so that the walk reaches it after every unit's
-- reduce-scatter was issued; with fail, that op's backward raises "boom: a
-- failing backward". Returns what backward returns (raises on failure).
function M.lm_backward(model, x, y, fail)
  local fsdp = require "fsdp"
  Boom = Boom or fsdp.Function {
    forward = function(ctx, v) return v * 1 end,
    backward = function(ctx, gout) error("boom: a failing backward") end,
  }
  local z = fsdp.tensor({ 1, 2 }):requires_grad(true)
  local b = fail and Boom(z) or z * 1
  local _, l = model(x, y)
  return (l + b:sum():cast(l:dtype()) * 0):backward()   -- (a bf16 model's loss is bf16)
end

function M.done()
  print(string.format("%d passed, %d failed", M.passed, M.failed))
  if M.passed + M.failed == 0 then
    io.stderr:write("FAIL: no checks ran (a test must check something)\n")
  end
  io.stdout:flush()
  if M.failed > 0 or M.passed == 0 then os.exit(1) end
end

return M
