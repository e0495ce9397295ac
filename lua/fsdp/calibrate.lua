-- fsdp.calibrate: this machine's CPU kernels measured for the planner's
-- time model (fsdp.plan_time), `fsdp-lua --calibrate`.
--
-- Each probe is a small piece of real work (a matmul, a LayerNorm forward
-- and backward, AdamW over a buffer, ...) run twice: on the CPU, timed
-- (best of a few), and on the counting device, whose kernel calls say what
-- it moved and computed. A probe is named after the kernel family its time
-- is mostly spent in; that family's rate is what is left of the measured
-- time once the other families' calls are priced with the rates found
-- before it (the probes run in that order). The model of a kernel call:
--
--   seconds = per_call + max(FLOPs / flop_rate(family), bytes / byte_rate(family))
--
-- flop_rate only for the GEMMs and the attention kernels (a GEMM's rate
-- taken between a small and a large one by FLOPs per call, log-linearly);
-- every other family is priced by its bytes. per_call is an op's cost
-- through the Lua API for an empty amount of work (dispatch, tape,
-- allocator). Rates are kept per thread count, in a JSON file:
-- $FSDP_CALIBRATION, or else $XDG_CACHE_HOME/fsdp-lua/calibration.json
-- (~/.cache/... without XDG_CACHE_HOME).
local fsdp = require "fsdp"
local json = require "fsdp.json"
local meta = require "fsdp.meta"
local timer = require "fsdp.timer"

local M = {}

M.VERSION = 1

--- The cache file's path.
function M.path()
  local p = os.getenv("FSDP_CALIBRATION")
  if p and p ~= "" then return p end
  local base = os.getenv("XDG_CACHE_HOME")
  if not base or base == "" then base = (os.getenv("HOME") or ".") .. "/.cache" end
  return base .. "/fsdp-lua/calibration.json"
end

-- Families whose calls are priced by FLOPs.
M.FLOP_FAMILIES = { gemm_f32 = true, gemm_bf16 = true, attention = true, attention_bf16 = true }

-- A family no probe measured takes the rate of another.
local stand_in = { copy = "elementwise", cast = "elementwise", reduce = "elementwise", init = "elementwise",
  transfer = "elementwise", softmax = "activation", attention_bf16 = "attention", gemm_bf16 = "gemm_f32",
  loss = "activation", embedding = "elementwise", optimizer = "elementwise", norm = "activation" }

--- Seconds of one kernel call with rates r (one thread count's table).
function M.price_call(r, family, name, rd, wr, flops, launches)
  if family == "memory" or family == "sync" or launches == 0 and flops == 0 and rd + wr == 0 then return 0 end
  local f = family
  while not r.rates[f] and stand_in[f] do f = stand_in[f] end
  local rate = r.rates[f] or r.rates.elementwise
  local t
  if M.FLOP_FAMILIES[family] then
    local fr = rate
    if f == "gemm_f32" and r.gemm_small and r.gemm_large_flops then   -- between the small and the large GEMM
      local lo, hi = r.gemm_small, { flops = r.gemm_large_flops, rate = r.rates.gemm_f32 }
      local x = (math.log(math.max(flops, 1)) - math.log(lo.flops)) / (math.log(hi.flops) - math.log(lo.flops))
      x = math.max(0, math.min(1, x))
      fr = math.exp(math.log(lo.rate) + x * (math.log(hi.rate) - math.log(lo.rate)))
    end
    t = math.max(flops / fr, (rd + wr) / r.rates.elementwise)
  else
    t = (rd + wr) / rate
  end
  return r.per_call + t
end

-- Runs fn on the meta device: its kernel calls, one list per family
-- { calls, bytes, flops, events = { {family, name, rd, wr, flops, launches} } }.
local function counted(setup)
  local C = require("fsdp.core").C
  local prev = fsdp.default_device()
  meta.mimic("cpu")
  fsdp.set_default_device("meta")
  local ok, err = pcall(function()
    local run = setup()
    run()   -- (as timed: after a first run)
    C.fsdp_timeline_record(1)
    run()
  end)
  C.fsdp_timeline_record(0)
  fsdp.set_default_device(prev)
  if not ok then error(err, 0) end
  return require("fsdp.plan_time").read_timeline()
end

local function best_time(fn, reps)
  fn()   -- warm: caches, the allocator, the JIT
  local best = math.huge
  for _ = 1, reps do
    local t0 = timer.now()
    fn()
    local dt = timer.now() - t0
    if dt < best then best = dt end
  end
  return best
end

local function probes()
  local optim = require "fsdp.optim"
  local P = {}
  local function add(family, what, setup) P[#P + 1] = { family = family, what = what, setup = setup } end
  add("per_call", "add of 1 element", function()
    local a, b = fsdp.randn({ 1 }), fsdp.randn({ 1 })
    return function() for _ = 1, 200 do local _ = a + b end end
  end)
  add("elementwise", "add of 2^21 f32", function()
    local a, b = fsdp.randn({ 2 ^ 21 }), fsdp.randn({ 2 ^ 21 })
    return function() local _ = a + b end
  end)
  add("gemm_small", "matmul 64 x 64 x 64", function()
    local a, b = fsdp.randn({ 64, 64 }), fsdp.randn({ 64, 64 })
    return function() for _ = 1, 20 do local _ = a:matmul(b) end end
  end)
  add("gemm_f32", "matmul 512 x 768 x 768", function()
    local a, b = fsdp.randn({ 512, 768 }), fsdp.randn({ 768, 768 })
    return function() local _ = a:matmul(b) end
  end)
  add("activation", "GELU forward and backward, 2^20 f32", function()
    local x = fsdp.randn({ 2 ^ 20 }, { requires_grad = true })
    return function() fsdp.gelu(x):sum():backward() end
  end)
  add("norm", "LayerNorm(512) forward and backward, 2048 rows", function()
    local w, b = fsdp.ones({ 512 }, { requires_grad = true }), fsdp.zeros({ 512 }, { requires_grad = true })
    local x = fsdp.randn({ 2048, 512 }, { requires_grad = true })
    return function() fsdp.layernorm(x, w, b):sum():backward() end
  end)
  add("attention", "causal attention forward and backward, 4 x 4 heads x 256 x 64", function()
    local q = fsdp.randn({ 4, 4, 256, 64 }, { requires_grad = true })
    return function() fsdp.attention(q, q, q, { causal = true }):sum():backward() end
  end)
  add("loss", "cross entropy forward and backward, 1024 x 4096", function()
    local logits = fsdp.randn({ 1024, 4096 }, { requires_grad = true })
    local y = fsdp.zeros({ 1024 }, { dtype = "i64" })
    return function() fsdp.cross_entropy(logits, y):backward() end
  end)
  add("embedding", "Embedding(8192, 256) forward and backward, 4096 ids", function()
    local w = fsdp.randn({ 8192, 256 }, { requires_grad = true })
    local ids = fsdp.zeros({ 4096 }, { dtype = "i64" })
    return function() fsdp.embedding(w, ids):sum():backward() end
  end)
  add("optimizer", "AdamW over 2^20 parameters", function()
    local p = fsdp.randn({ 2 ^ 20 }, { requires_grad = true })
    p.grad = fsdp.randn({ 2 ^ 20 })
    local opt = optim.AdamW({ p }, { lr = 1e-3 })
    return function() opt:step() end
  end)
  return P
end

--- Measures this machine's rates with `threads` CPU threads (default: as
-- set now). Returns { threads, per_call, rates = { [family] = bytes/s or
-- FLOP/s }, gemm_small = { flops, rate }, probes = { ... } }.
function M.measure(threads)
  local prev_threads = fsdp.num_threads()
  if threads then fsdp.set_num_threads(threads) end
  local r = { threads = fsdp.num_threads(), per_call = 0, rates = {}, probes = {} }
  local ok, err = pcall(function()
    for _, p in ipairs(probes()) do
      -- the same work on the counting device, then on the CPU
      local events = counted(p.setup)
      local run = p.setup()
      local seconds = best_time(run, 5)
      if p.family == "per_call" then
        r.per_call = seconds / math.max(1, #events)
      else
        -- what the other families' calls cost at the rates so far
        local fam = p.family == "gemm_small" and "gemm_f32" or p.family
        local others, work, calls, flops = 0, 0, 0, 0
        for _, e in ipairs(events) do
          if e.family == fam then
            calls = calls + 1
            work = work + (M.FLOP_FAMILIES[fam] and e.flops or e.rd + e.wr)
            flops = flops + e.flops
          elseif r.rates.elementwise then
            others = others + M.price_call(r, e.family, e.name, e.rd, e.wr, e.flops, e.launches)
          end
        end
        local own = math.max(seconds - others - calls * r.per_call, seconds * 0.05)
        local rate = work / own
        if p.family == "gemm_small" then
          r.gemm_small = { flops = flops / math.max(calls, 1), rate = rate }
        else
          r.rates[fam] = rate
          if fam == "gemm_f32" then r.gemm_large_flops = flops / math.max(calls, 1) end
        end
        r.probes[#r.probes + 1] = { family = p.family, what = p.what, seconds = seconds, rate = rate }
      end
      collectgarbage()
    end
  end)
  fsdp.set_num_threads(prev_threads)
  if not ok then error(err, 0) end
  if r.gemm_small and r.gemm_large_flops then
    r.gemm_small.flops = math.min(r.gemm_small.flops, r.gemm_large_flops / 2)
  end
  return r
end

-- One host's collectives under mpirun: all-gathers of a small and a large
-- block, fitted to the alpha-beta form fsdp.plan_time prices them with.
local function measure_comm()
  local ffi = require "ffi"
  local core = require "fsdp.core"
  local dist = require "fsdp.distributed"
  local C, raise = core.C, core.raise
  local g = dist.world_group()
  local n = g:size()
  local box = ffi.new("fsdp_work *[1]")
  local function gather_time(block)
    local src = fsdp.zeros({ block }, { device = "cpu" })
    local dst = fsdp.zeros({ block * n }, { device = "cpu" })
    local function once()
      if C.fsdp_all_gather(box, g.comm, dst, src, "calibrate") ~= 0 then raise() end
      local w = box[0]
      if C.fsdp_work_wait(w) ~= 0 then C.fsdp_work_free(w) raise() end
      C.fsdp_work_free(w)
    end
    once()
    local best = math.huge
    for _ = 1, 5 do
      g:barrier()
      local t0 = timer.now()
      once()
      best = math.min(best, timer.now() - t0)
    end
    return dist.max(best), 4 * block * n
  end
  local log2n = math.ceil(math.log(n) / math.log(2) - 1e-9)
  local t_small = gather_time(256)
  local latency = t_small / (log2n + 2 * log2n)
  local t_large, bytes = gather_time(2 ^ 21)
  local wire = bytes * (n - 1) / n
  local rate = wire / math.max(t_large - latency * ((n - 1) + 2 * log2n), t_large * 0.1)
  return { latency = latency, rate = rate, ranks = n }
end

local function cores()
  local f = io.popen("nproc 2>/dev/null")
  local n = f and tonumber(f:read("*l") or "")
  if f then f:close() end
  return n or fsdp.num_threads()
end

--- `fsdp-lua --calibrate`: measures at 1 thread and at every core, writes
-- the cache, prints what it found.
function M.run()
  local path = M.path()
  local dist = require "fsdp.distributed"
  if dist.world() > 1 then
    -- under mpirun: this host's collectives (the kernels were measured alone, without mpirun)
    local c = measure_comm()
    if dist.rank() ~= 0 then return end
    local cache = M.read() or { version = M.VERSION, cpu = {} }
    cache.intra = c
    M.write(path, cache)
    io.stdout:write(string.format("calibrate: one host's MPI over %d ranks: latency %.1f us, %.2f GB/s per rank\n",
      c.ranks, c.latency * 1e6, c.rate / 1e9))
    io.stdout:write("calibrate: wrote " .. path .. "\n")
    return
  end
  local n = cores()
  local old = M.read()
  local cache = { version = M.VERSION, cores = n, cpu = {}, intra = old and old.intra }
  for _, th in ipairs(n > 1 and { 1, n } or { 1 }) do
    local r = M.measure(th)
    cache.cpu[tostring(th)] = r
    io.stdout:write(string.format("calibrate: %d thread%s: per call %.1f us, GEMM %.1f GFLOP/s (%.1f at 64^3), "
      .. "elementwise %.1f GB/s, attention %.1f GFLOP/s\n", th, th == 1 and "" or "s", r.per_call * 1e6,
      r.rates.gemm_f32 / 1e9, r.gemm_small.rate / 1e9, r.rates.elementwise / 1e9, r.rates.attention / 1e9))
  end
  M.write(path, cache)
  io.stdout:write("calibrate: wrote " .. path .. "\n")
  if not cache.intra then
    io.stdout:write("calibrate: for one host's collectives too: mpirun -np 2 fsdp-lua --calibrate\n")
  end
end

function M.write(path, cache)
  local dir = path:match("^(.*)/[^/]*$")
  if dir then os.execute("mkdir -p '" .. dir:gsub("'", "'\\''") .. "'") end
  local ok, err = pcall(require("fsdp.io").write_atomic, path, json.encode(cache) .. "\n")
  if not ok then error("fsdp-lua --calibrate: cannot write '" .. path .. "': " .. tostring(err), 0) end
end

--- The whole cache, or nil and why not.
function M.read()
  local path = M.path()
  local f = io.open(path, "r")
  if not f then return nil, "no calibration at " .. path .. " (run fsdp-lua --calibrate)" end
  local text = f:read("*a")
  f:close()
  local ok, cache = pcall(json.decode, text)
  if not ok or type(cache) ~= "table" or cache.version ~= M.VERSION or type(cache.cpu) ~= "table" then
    return nil, "the calibration at " .. path .. " is damaged or of another version (run fsdp-lua --calibrate)"
  end
  return cache
end

--- The cache's rates for `threads` threads (the nearest count measured),
-- or nil and why not.
function M.load(threads)
  local cache, why = M.read()
  if not cache then return nil, why end
  local path = M.path()
  local best, bd
  for k, r in pairs(cache.cpu) do
    local d = math.abs(tonumber(k) - threads)
    if not bd or d < bd then best, bd = r, d end
  end
  if not best then return nil, "the calibration at " .. path .. " holds no CPU figures" end
  return best, nil, cache.intra
end

return M
