-- The compressed reduce-scatter (fsdp_reduce_scatter_compressed) against a
-- double-precision re-implementation here: every rank makes every rank's
-- input from (seed, rank), quantizes (int8 blocks) or selects (top-k) each
-- part as the engine's comment describes, sums the parts in rank order,
-- divides, and compares its own block and its own residual. Awkward part
-- sizes (1, odd, primes, smaller than a block, not a multiple of it), with
-- and without error feedback, two rounds (the second compresses src plus
-- the first round's residual). Also: the wire bytes counted, and bad input.
--   mpirun -np 3 fsdp-lua tests/distributed/test_compress_collective.lua
package.path = "tests/lua/?.lua;" .. package.path
local t = require "testlib"
local ffi = require "ffi"
local fsdp = require "fsdp"
local core = require "fsdp.core"
local C = core.C

local rank, world = fsdp.rank(), fsdp.world()
local comm_box = ffi.new("fsdp_comm *[1]")
assert(C.fsdp_comm_world(comm_box) == 0)
local comm = comm_box[0]
local f32 = ffi.new("float[1]")
local function round_f32(x) f32[0] = x; return f32[0] end

-- a deterministic value per (seed, rank, i), f32, with spread magnitudes
local function value(seed, r, i)
  local x = math.sin(seed * 12.9898 + r * 78.233 + i * 37.719) * 43758.5453
  x = x - math.floor(x)
  local mag = 10 ^ (3 * math.sin(i * 0.37 + r + seed) - 1)
  return round_f32((x - 0.5) * mag)
end

local function tensor_of(vals)
  local tt = fsdp.empty({ #vals }, { dtype = "f32" })
  local p = ffi.cast("float *", tt:data_ptr())
  for i = 1, #vals do p[i - 1] = vals[i] end
  return tt
end
local function values_of(tt)
  local p, out = ffi.cast("float *", tt:data_ptr()), {}
  for i = 1, tt:numel() do out[i] = p[i - 1] end
  return out
end

local function lrint(x)   -- round half to even, as lrintf in the default mode
  local f = math.floor(x)
  local d = x - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then return f + 1 end
  return f
end

-- What rank r sends for part q (n elements) of v (its whole vector, 1-based):
-- the decompressed values (a table of n) and what is left in its residual.
local function compress_ref(mode, v, q, n, block, density)
  local sent, left = {}, {}
  local base = q * n
  if mode == 1 then
    for lo = 0, n - 1, block do
      local hi = math.min(lo + block, n)
      local amax = 0
      for i = lo, hi - 1 do amax = math.max(amax, math.abs(v[base + i + 1])) end
      local scale = round_f32(amax / 127)
      for i = lo, hi - 1 do
        local x = v[base + i + 1]
        local qv = scale > 0 and math.max(-127, math.min(127, lrint(x / scale))) or 0
        sent[i + 1] = qv * scale
        left[i + 1] = x - qv * scale
      end
    end
  else
    local k = math.max(1, math.min(n, math.ceil(density * n)))
    local order = {}
    for i = 1, n do order[i] = i end
    table.sort(order, function(a, b)
      local ma, mb = math.abs(v[base + a]), math.abs(v[base + b])
      if ma ~= mb then return ma > mb end
      return a < b
    end)
    for i = 1, n do sent[i], left[i] = 0, v[base + i] end
    for j = 1, k do
      local i = order[j]
      sent[i], left[i] = v[base + i], 0
    end
  end
  return sent, left
end

local function part_bytes(mode, n, block, density)
  if mode == 1 then return 4 * math.ceil(n / block) + math.ceil(n / 4) * 4 end
  return 8 * math.max(1, math.min(n, math.ceil(density * n)))
end

local stats = ffi.new("int64_t[4]")
local function traffic()
  assert(C.fsdp_comm_stats(stats, stats + 1, nil) == 0)
  assert(C.fsdp_comm_wire_stats(stats + 2, stats + 3) == 0)
  return tonumber(stats[1]), tonumber(stats[3])
end

-- One case: n elements per part; two rounds, with or without residuals.
local function run_case(mode, n, block, density, feedback, seed)
  local total = n * world
  local res_all = {}   -- every rank's residual (reference), 1-based per rank
  for r = 0, world - 1 do
    res_all[r] = {}
    for i = 1, total do res_all[r][i] = feedback and round_f32(value(seed + 99, r, i) * 0.01) or 0 end
  end
  local residual = feedback and tensor_of(res_all[rank]) or nil
  local label = string.format("%s n=%d block=%d density=%g ef=%s", mode == 1 and "int8" or "topk", n, block, density,
    tostring(feedback))
  local worst, flips, res_worst = 0, 0, 0
  for round = 1, 2 do
    local src_all = {}
    for r = 0, world - 1 do
      src_all[r] = {}
      for i = 1, total do src_all[r][i] = value(seed + round, r, i) end
    end
    local src, dst = tensor_of(src_all[rank]), fsdp.empty({ n }, { dtype = "f32" })
    local r0, w0 = traffic()
    local st = C.fsdp_reduce_scatter_compressed(nil, comm, dst, src, residual, mode, block, density, 1, label)
    if st ~= 0 then error(core.last_error and core.last_error() or ffi.string(C.fsdp_last_error())) end
    local r1, w1 = traffic()
    t.eq(r1 - r0, 4 * total, label .. ": logical bytes counted")
    t.eq(w1 - w0, part_bytes(mode, n, block, density) * world, label .. ": wire bytes counted")
    -- reference: each rank's v = f32(src + residual), compressed per part
    local sum, quantum, mag, res_tol = {}, {}, {}, {}
    for i = 1, n do sum[i], quantum[i], mag[i] = 0, 0, 0 end
    for r = 0, world - 1 do
      local v = {}
      for i = 1, total do v[i] = round_f32(src_all[r][i] + (feedback and res_all[r][i] or 0)) end
      for q = 0, world - 1 do
        local sent, left = compress_ref(mode, v, q, n, block, density)
        if q == rank then
          for i = 1, n do
            sum[i] = sum[i] + sent[i]
            mag[i] = mag[i] + math.abs(sent[i])
            if mode == 1 then   -- one quantum of this rank's block
              local lo = math.floor((i - 1) / block) * block
              local amax = 0
              for j = lo + 1, math.min(lo + block, n) do amax = math.max(amax, math.abs(v[q * n + j])) end
              quantum[i] = quantum[i] + amax / 127
            end
          end
        end
        if feedback then
          for i = 1, n do
            res_all[r][q * n + i] = round_f32(left[i])
            -- the engine rounds q * scale to f32 before it subtracts
            if r == rank then res_tol[q * n + i] = 1e-6 * (math.abs(left[i]) + math.abs(v[q * n + i])) + 1e-30 end
          end
        end
      end
    end
    local got = values_of(dst)
    for i = 1, n do
      local want = sum[i] / world
      local d = math.abs(got[i] - want)
      local tol = 1e-6 * mag[i] / world + 1e-30   -- each q * scale rounded to f32, then f32 adds
      if d > tol then
        -- an element whose v / scale fell on a rounding boundary in f32 but not in
        -- double (or the reverse) may differ by one quantum of one rank
        if mode == 1 and d <= quantum[i] / world * 1.001 then flips = flips + 1 else worst = math.max(worst, d / (tol)) end
      end
    end
    if feedback then
      local gr = values_of(residual)
      for i = 1, total do
        local want = res_all[rank][i]
        local d = math.abs(gr[i] - want)
        if d > res_tol[i] then res_worst = math.max(res_worst, d) end
        res_all[rank][i] = gr[i]   -- go on from the engine's (a flip above changes both alike)
      end
    end
  end
  t.ok(worst == 0, label .. ": owner's sum equals the double reference" .. (worst > 0 and (" (worst " .. worst .. " x tol)") or ""))
  t.ok(flips <= 2, label .. ": at most 2 elements one quantum apart (" .. flips .. ")")
  t.ok(res_worst == 0 or (mode == 1 and flips > 0), label .. ": residual equals the reference")
end

local seed = 1
for _, n in ipairs({ 1, 5, 7, 13, 255, 300, 1031 }) do
  for _, block in ipairs({ 4, 256 }) do
    for _, fb in ipairs({ false, true }) do
      run_case(1, n, block, 1, fb, seed)
      seed = seed + 3
    end
  end
  for _, density in ipairs({ 0.01, 0.3, 1 }) do
    for _, fb in ipairs({ false, true }) do
      run_case(2, n, 256, density, fb, seed)
      seed = seed + 3
    end
  end
end

-- bad input: one clear error each, on every rank alike (nothing is issued)
local function fails(fn, needle, name)
  local st = fn()
  local msg = ffi.string(C.fsdp_last_error())
  t.ok(st ~= 0 and msg:find(needle, 1, true) ~= nil, name .. " (" .. msg .. ")")
end
local src, dst = fsdp.zeros({ 4 * world }), fsdp.zeros({ 4 })
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, dst, src, nil, 7, 256, 0.1, 1, "x") end,
  "mode 7", "unknown mode")
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, dst, src, nil, 1, 3, 0.1, 1, "x") end,
  "block 3, expected a power of two", "block not a power of two")
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, dst, src, nil, 1, 0, 0.1, 1, "x") end,
  "block 0", "block 0")
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, dst, src, nil, 2, 256, 0, 1, "x") end,
  "density 0, expected in (0, 1]", "density 0")
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, dst, src, nil, 2, 256, 1.5, 1, "x") end,
  "density 1.5", "density above 1")
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, dst, src, fsdp.zeros({ 3 }), 1, 256, 0.1, 1, "x") end,
  "residual", "a residual of the wrong size")
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, dst, fsdp.zeros({ 5 * world }), nil, 1, 256, 0.1, 1,
  "x") end, "elements, expected size", "src of the wrong size")
local b16s, b16d = fsdp.zeros({ 4 * world }, { dtype = "bf16" }), fsdp.zeros({ 4 }, { dtype = "bf16" })
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, b16d, b16s, nil, 1, 256, 0.1, 1, "x") end,
  "f32", "bf16 tensors")
fails(function() return C.fsdp_reduce_scatter_compressed(nil, comm, dst, src, src, 1, 256, 0.1, 1, "x") end,
  "overlap", "residual aliasing src")

t.done()
