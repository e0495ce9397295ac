-- bench_ckpt.lua: save and load throughput of sharded checkpoints (driven
-- by tools/dev/bench_ckpt.sh, which measures the raw disk next to it).
--   mpirun -np 2 fsdp-lua tools/dev/bench_ckpt.lua --dir=build/bench_ckpt --preset=small --reps=3
-- The model is GPT-2 (small: 124M) sharded with full_shard over the ranks,
-- with AdamW state (one step on zero gradients creates it): parameters and
-- both moments, 12 bytes per parameter in all. Times are the slowest rank's,
-- from a barrier before to the return of the collective call (which
-- includes fsync, the index and the rename). "cold" loads first drop the
-- shard files from the page cache (posix_fadvise DONTNEED after fsync),
-- "warm" loads read them from memory.
local ffi = require "ffi"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local ck = require "fsdp.checkpoint"
local now = require("fsdp.timer").now

ffi.cdef [[
  int fsdp_bench_open(const char *path, int flags) __asm__("open");
  int fsdp_bench_close(int fd) __asm__("close");
  int fsdp_bench_fadvise(int fd, int64_t off, int64_t len, int advice) __asm__("posix_fadvise");
  int usleep(unsigned int usec);
]]
local POSIX_FADV_DONTNEED = 4

local o = ... or {}
local dir = o.dir or "build/bench_ckpt"
local preset = o.preset or "small"
local reps = o.reps or 3
local strategy = o.strategy or "full_shard"
local presets = {
  tiny = { vocab_size = 256, n_layer = 2, n_head = 4, n_embd = 64, block_size = 64 },
  small = { vocab_size = 50257, n_layer = 12, n_head = 12, n_embd = 768, block_size = 1024 },
}
if o.threads then fsdp.set_num_threads(o.threads) end

local rank, world = fsdp.rank(), fsdp.world()
local model = nn.GPT(presets[preset])
local sh = fsdp.shard(model, { policy = fsdp.policy.per_block(), strategy = strategy, seed = 1 })
local opt = optim.AdamW(sh:param_groups(0.1), { lr = 1e-4 })
opt:step()   -- zero gradients: creates the moments

local function max_over_ranks(v) return fsdp.distributed.max(v) end
local function barrier() fsdp.distributed.barrier() end

local function evict(path)
  local index = ck.read_index(path)
  for i, fe in ipairs(index.files) do
    if (i - 1) % world == rank then
      local fd = ffi.C.fsdp_bench_open(path .. "/" .. fe.name, 0)
      if fd >= 0 then
        ffi.C.fsdp_bench_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)
        ffi.C.fsdp_bench_close(fd)
      end
    end
  end
  barrier()
end

local function timed(fn)
  barrier()
  local t0 = now()
  fn()
  return max_over_ranks(now() - t0)
end

-- rank 0 runs dd while the others sleep (an MPI barrier would spin and take
-- a core from dd): raw write speed of the same disk, between the checkpoint
-- runs, for the same number of bytes; one dd, and one per rank in parallel
local function raw_dd(bytes, parallel)
  local flag = dir .. "/dd.done"
  if rank == 0 then os.remove(flag) end
  barrier()
  local secs = 0
  if rank == 0 then
    local n = parallel and world or 1
    local mib = math.ceil(bytes / n / 1048576)
    local cmd = {}
    for i = 1, n do
      cmd[i] = string.format("dd if=/dev/zero of='%s/dd%d.bin' bs=1M count=%d conv=fsync status=none &", dir, i, mib)
    end
    os.execute("sync")
    local t0 = now()
    os.execute(table.concat(cmd, " ") .. " wait")
    secs = (now() - t0) * bytes / (n * mib * 1048576)   -- per checkpoint byte
    os.execute(string.format("rm -f '%s'/dd*.bin; sync; touch '%s'", dir, flag))
  else
    while not io.open(flag, "rb") do ffi.C.usleep(20000) end
  end
  return max_over_ranks(secs)
end

local function quiet()
  if rank == 0 then os.execute("sync") end
  barrier()
end

if rank == 0 then os.execute("rm -rf '" .. dir .. "' && mkdir -p '" .. dir .. "'") end
barrier()
local res = { save = {}, cold = {}, warm = {}, dd = {}, ddp = {} }
local total, per, nfiles = 0, 0, 0
for rep = 1, reps do
  local path = string.format("%s/ckpt_%d", dir, rep)
  quiet()
  res.save[rep] = timed(function() ck.save(path, { model = sh, optim = opt, step = rep }) end)
  if rep == 1 then
    for _, fe in ipairs(ck.read_index(path).files) do
      total = total + fe.bytes
      per = math.max(per, fe.bytes)
      nfiles = nfiles + 1
    end
  end
  evict(path)
  res.cold[rep] = timed(function() ck.load(path, { model = sh, optim = opt }) end)
  res.warm[rep] = timed(function() ck.load(path, { model = sh, optim = opt }) end)
  if rank == 0 then os.execute("rm -rf '" .. path .. "'") end
  res.dd[rep] = raw_dd(total, false)
  res.ddp[rep] = raw_dd(total, true)
end

if rank == 0 then
  local function median(l)
    local c = {}
    for i, v in ipairs(l) do c[i] = v end
    table.sort(c)
    return c[math.floor((#c + 1) / 2)]
  end
  local function list(l)
    local p = {}
    for i, v in ipairs(l) do p[i] = string.format("%.2f", total / v / 1e9) end
    return table.concat(p, " ")
  end
  print(string.format("checkpoint: GPT-2 %s, %s, %d rank(s), %d files, %.3f GB in all, %.3f GB per rank "
    .. "(params + AdamW moments, f32)", preset, strategy, world, nfiles,
    total / 1e9, per / 1e9))
  local dd1, ddp = median(res.dd), median(res.ddp)
  print(string.format("%-18s %.3f s: %.2f GB/s (runs: %s GB/s)", "raw dd, 1 writer", dd1, total / dd1 / 1e9,
    list(res.dd)))
  print(string.format("%-18s %.3f s: %.2f GB/s (runs: %s GB/s)", "raw dd, " .. world .. " writers", ddp,
    total / ddp / 1e9, list(res.ddp)))
  local dd = math.min(dd1, ddp)   -- compare with the faster raw figure
  for _, k in ipairs({ "save", "cold", "warm" }) do
    local t = median(res[k])
    local label = k == "save" and "save" or ("load (" .. k .. ")")
    print(string.format("%-18s %.3f s: %.2f GB/s per rank, %.2f GB/s total, %3.0f%% of raw write (runs: %s GB/s)",
      label, t, per / t / 1e9, total / t / 1e9, 100 * dd / t, list(res[k])))
  end
end
