-- fsdp.distributed: the ranks of a job, from Lua, without the FFI.
--
--   local dist = require "fsdp.distributed"
--   dist.rank(), dist.world(), dist.local_rank()   -- 0-based rank, rank count, rank on this node
--   dist.local_size()                              -- ranks on this node
--   dist.mean(loss)                                -- a number or a list of numbers, over all ranks
--   dist.sum({ tokens, seconds }); dist.max(peak); dist.min(free)
--   dist.print0("step %d | loss %.4f", step, loss) -- rank 0 prints (string.format arguments)
--   dist.barrier()
--   local cfg = dist.broadcast(cfg)                -- rank 0's string, number, boolean or table
--   local g = dist.world_group():split(color, key) -- groups are objects with the same calls
--   g:sum(x); g:rank(); g:size()
--
-- On a world of one every call returns its argument and touches no
-- communicator, so a recipe has one code path for 1 and N ranks. Every
-- collective must be called by every rank of its group, in the same order,
-- with lists of the same length.
local ffi = require "ffi"
local core = require "fsdp.core"
local json = require "fsdp.json"

local C, raise = core.C, core.raise

local M = {}

-- The engine's reduce ops (fsdp_reduce_op in fsdp.h).
local REDUCE_SUM, REDUCE_AVG, REDUCE_MAX = C.FSDP_REDUCE_SUM, C.FSDP_REDUCE_AVG, C.FSDP_REDUCE_MAX
-- Bytes packed into one double when strings travel as a sum of doubles:
-- 6 bytes < 2^48 stay exact, and all ranks but the root add zeros.
local BYTES_PER_DOUBLE = 6
-- The root of a broadcast when none is given.
local DEFAULT_ROOT = 0

local int2 = ffi.new("int[2]")

local function runtime()
  if C.fsdp_runtime_rank(int2, int2 + 1) ~= 0 then raise() end
  return int2[0], int2[1]
end

-- The world a dry run stands in (fsdp.plan: N ranks played by this process
-- over a communicator that moves nothing), or nil for the real one.
local world_override = nil

-- True while a dry run stands in for the world (fsdp.plan).
function M._dry_run() return world_override ~= nil end

-- The ranks this job runs with, whatever a dry run lets recipes see.
function M._ranks_running()
  local _, w = runtime()
  return w
end

--- This process's rank in the world, 0-based.
function M.rank()
  if world_override then return world_override._rank end
  local r = runtime()
  return r
end

--- The number of ranks in the job (N while `--plan --world=N` plans).
function M.world()
  if world_override then return world_override._size end
  local _, w = runtime()
  return w
end

--- This rank's index among the ranks on its node and their count (0 and 1
-- in a world of one), from MPI's shared-memory split: any launcher.
function M.local_rank()
  if C.fsdp_runtime_local(int2, int2 + 1) ~= 0 then raise() end
  return int2[0]
end
function M.local_size()
  if C.fsdp_runtime_local(int2, int2 + 1) ~= 0 then raise() end
  return int2[1]
end

--- True on rank 0.
function M.is_main() return M.rank() == 0 end

-- ---- groups ----

local Group = {}
Group.__index = Group
M.Group = Group

local comm_box = ffi.new("fsdp_comm *[1]")

-- A group over a communicator handle (owned: freed by the collector or :free()).
local function group_of(comm)
  if C.fsdp_comm_info(comm, int2, int2 + 1) ~= 0 then raise() end
  return setmetatable({ comm = ffi.gc(comm, C.fsdp_comm_free), _rank = int2[0], _size = int2[1] }, Group)
end

-- A group over a handle a library module keeps owning (not freed here).
function M._borrow(comm)
  if C.fsdp_comm_info(comm, int2, int2 + 1) ~= 0 then raise() end
  return setmetatable({ comm = comm, _rank = int2[0], _size = int2[1], borrowed = true }, Group)
end

local world_group
-- After ranks were brought back in step (the REPL, after a chunk that
-- failed on some of them): every sharded model's units back to their shards
-- on this rank, hpZ parts dropped, issued gathers waited for.
function M._reshard_all()
  if C.fsdp_sched_reshard_all() ~= 0 then raise() end
end

--- The group of every rank.
function M.world_group()
  if world_override then return world_override end
  if not world_group then
    if C.fsdp_comm_world(comm_box) ~= 0 then raise() end
    world_group = group_of(comm_box[0])
  end
  return world_group
end

function Group:rank() return self._rank end
function Group:size() return self._size end

--- Ranks passing the same color form a new group, ordered by key (default:
-- the rank here). Collective over this group.
function Group:split(color, key)
  if type(color) ~= "number" or color ~= math.floor(color) or color < 0 then
    error("fsdp.distributed: split color must be a non-negative integer, got " .. tostring(color), 2)
  end
  key = key or self._rank
  if C.fsdp_comm_split(comm_box, self.comm, color, key) ~= 0 then raise() end
  return group_of(comm_box[0])
end

--- A new group for each color: color_of(r) gives rank r's color (>= 0)
-- and optionally its key (default r), computed alike on every rank, so
-- that a group also splits where no rank sees the others (a counting one).
-- Collective over this group.
function Group:split_by(color_of)
  if self.comm == nil then error("fsdp.distributed.split_by: the group was freed", 2) end
  local n = self._size
  local colors, keys = ffi.new("int[?]", n), ffi.new("int[?]", n)
  for r = 0, n - 1 do
    local color, key = color_of(r)
    if type(color) ~= "number" or color ~= math.floor(color) or color < 0 then
      error(string.format("fsdp.distributed: split_by: the color of rank %d must be a non-negative integer, got %s",
        r, tostring(color)), 2)
    end
    colors[r], keys[r] = color, key or r
  end
  if C.fsdp_comm_split_all(comm_box, self.comm, colors, keys, n) ~= 0 then raise() end
  return group_of(comm_box[0])
end

--- Gives the communicator back now (the group is unusable afterwards).
function Group:free()
  if self.freed then return end
  self.freed = true
  if self.comm ~= nil and not self.borrowed then C.fsdp_comm_free(ffi.gc(self.comm, nil)) end
  self.comm = nil
end

function Group:__tostring()
  return string.format("fsdp.distributed group (rank %d of %d)", self._rank, self._size)
end

local function live(g, op)
  if g.freed then error("fsdp.distributed." .. op .. ": the group was freed", 4) end
end

-- Reduces a number or a list of numbers; the same shape comes back.
local function reduce(g, x, op, name)
  local is_list = type(x) == "table"
  if not is_list and type(x) ~= "number" then
    error(string.format("fsdp.distributed.%s: expected a number or a list of numbers, got %s", name, type(x)), 3)
  end
  if is_list then
    for i = 1, #x do
      if type(x[i]) ~= "number" then
        error(string.format("fsdp.distributed.%s: entry %d is a %s, expected a number", name, i, type(x[i])), 3)
      end
    end
  end
  live(g, name)
  if g._size == 1 then return x end
  local n = is_list and #x or 1
  local buf = ffi.new("double[?]", math.max(n, 1))
  local neg = op == "min"   -- min(x) = -max(-x)
  for i = 1, n do
    local v = is_list and x[i] or x
    buf[i - 1] = neg and -v or v
  end
  local code = (op == "sum" and REDUCE_SUM) or (op == "mean" and REDUCE_AVG) or REDUCE_MAX
  if C.fsdp_all_reduce_doubles(g.comm, buf, n, code) ~= 0 then raise() end
  if not is_list then return neg and -buf[0] or buf[0] end
  local out = {}
  for i = 1, n do out[i] = neg and -buf[i - 1] or buf[i - 1] end
  return out
end

function Group:sum(x) return reduce(self, x, "sum", "sum") end
function Group:mean(x) return reduce(self, x, "mean", "mean") end
function Group:max(x) return reduce(self, x, "max", "max") end
function Group:min(x) return reduce(self, x, "min", "min") end

--- Waits until every rank of the group arrives.
function Group:barrier()
  live(self, "barrier")
  if self._size == 1 then return end
  if C.fsdp_barrier(self.comm) ~= 0 then raise() end
end

-- A string from the root to every rank: its length, then its bytes, as
-- sums of doubles to which only the root contributes.
-- The same reduction carries the largest and smallest root named, so that
-- ranks naming different roots fail together instead of mixing bytes.
local function broadcast_string(g, s, root)
  local is_root = g._rank == root
  local got = reduce(g, { is_root and #s or -1, root, -root }, "max", "broadcast")
  local len, hi, lo = got[1], got[2], -got[3]
  if hi ~= lo then
    local at_lo = reduce(g, root == lo and g._rank or math.huge, "min", "broadcast")
    local at_hi = reduce(g, root == hi and g._rank or math.huge, "min", "broadcast")
    error(string.format("fsdp.distributed.broadcast: ranks name different roots: rank %d names root %d, rank %d "
      .. "names root %d (every rank must pass the same root)", at_lo, lo, at_hi, hi), 3)
  end
  local n = math.ceil(len / BYTES_PER_DOUBLE)
  local buf = ffi.new("double[?]", math.max(n, 1))
  if is_root then
    for i = 0, n - 1 do
      local v = 0
      for j = BYTES_PER_DOUBLE, 1, -1 do v = v * 256 + (s:byte(i * BYTES_PER_DOUBLE + j) or 0) end
      buf[i] = v
    end
  end
  if n > 0 and C.fsdp_all_reduce_doubles(g.comm, buf, n, REDUCE_SUM) ~= 0 then raise() end
  if is_root then return s end
  local bytes = ffi.new("uint8_t[?]", math.max(len, 1))
  for i = 0, n - 1 do
    local v = buf[i]
    for j = 0, BYTES_PER_DOUBLE - 1 do
      local k = i * BYTES_PER_DOUBLE + j
      if k < len then bytes[k] = v % 256 end
      v = math.floor(v / 256)
    end
  end
  return ffi.string(bytes, len)
end

--- The root's value on every rank: a string, number, boolean, nil or a
-- table of those (JSON-shaped: arrays and string keys). Other ranks'
-- arguments are ignored.
function Group:broadcast(value, root)
  root = root or DEFAULT_ROOT
  if type(root) ~= "number" or root < 0 or root >= self._size or root ~= math.floor(root) then
    error(string.format("fsdp.distributed.broadcast: root %s, expected 0..%d", tostring(root), self._size - 1), 2)
  end
  live(self, "broadcast")
  if self._size == 1 then return value end
  -- a value the root cannot send still travels, as an error every rank
  -- raises: no rank is left waiting in the collective
  local payload = ""
  if self._rank == root then
    local t = type(value)
    if t == "string" then
      payload = "s" .. value
    elseif t == "nil" then
      payload = "n"
    elseif t ~= "number" and t ~= "boolean" and t ~= "table" then
      payload = "e" .. "cannot send a " .. t .. " (strings, numbers, booleans, nil and tables of them only)"
    else
      local ok, text = pcall(json.encode, value)
      payload = ok and ("j" .. text) or ("e" .. tostring(text))
    end
  end
  payload = broadcast_string(self, payload, root)
  local kind, body = payload:sub(1, 1), payload:sub(2)
  if kind == "e" then
    error(string.format("fsdp.distributed.broadcast: rank %d (the root): %s", root, body), 2)
  end
  if self._rank == root then return value end
  if kind == "s" then return body end
  if kind == "n" then return nil end
  return json.decode(body)
end

--- Prints (as string.format(fmt, ...), or the values tab-separated) on
-- this group's rank 0 only.
function Group:print0(...)
  if self._rank ~= 0 then return end
  local n = select("#", ...)
  local first = ...
  if n > 1 and type(first) == "string" and first:find("%", 1, true) then
    io.stdout:write(string.format(...), "\n")
  else
    local parts = {}
    for i = 1, n do parts[i] = tostring((select(i, ...))) end
    io.stdout:write(table.concat(parts, "\t"), "\n")
  end
end

-- ---- the same calls over the world ----

-- A one-rank world needs no communicator at all.
local single = setmetatable({ _rank = 0, _size = 1 }, Group)
local function default_group()
  if world_override then return world_override end
  local _, w = runtime()
  if w == 1 then return single end
  return M.world_group()
end

--- A group of `world` ranks that this process plays alone, as `rank`:
-- collectives move nothing and wait for nobody, with the results of a
-- world whose ranks all hold what this one holds (the planner's).
function M.counting_group(world, rank)
  if C.fsdp_comm_new_counting(comm_box, world, rank) ~= 0 then raise() end
  return group_of(comm_box[0])
end

-- Makes g (a group, or nil for the real world) the world that rank(),
-- world(), world_group() and the calls over the world see; returns the
-- previous one (a dry run's, fsdp.dryrun).
function M._set_world(g)
  local prev = world_override
  world_override = g
  return prev
end

function M.sum(x) return reduce(default_group(), x, "sum", "sum") end
function M.mean(x) return reduce(default_group(), x, "mean", "mean") end
function M.max(x) return reduce(default_group(), x, "max", "max") end
function M.min(x) return reduce(default_group(), x, "min", "min") end
function M.barrier() return default_group():barrier() end
function M.broadcast(value, root) return default_group():broadcast(value, root) end
local quiet = false
function M.print0(...)
  if M.rank() == 0 and not quiet then single.print0(single, ...) end
end

-- While on, print0 prints nothing: a dry run's log lines would show the
-- counting device's figures as if measured (fsdp.dryrun). Returns the
-- previous setting.
function M._set_quiet(on)
  local was = quiet
  quiet = on and true or false
  return was
end

return M
