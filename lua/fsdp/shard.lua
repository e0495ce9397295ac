-- fsdp.shard: Fully Sharded Data Parallel for nn modules.
--
--   local sharded = fsdp.shard(model, {
--     policy = fsdp.policy.per_block(),          -- or by_type, by_size, any function(module, path)
--     strategy = "full_shard",                   -- shard_grad_op, no_shard, hybrid_shard (+ group_size)
--     mixed_precision = { compute = "bf16", reduce = "f32" },
--     prefetch = "backward_pre", forward_prefetch = true, limit = 2, seed = 1,
--     offload = false,                           -- true: shards, gradients, optimizer state on the CPU
--     reshard_after_forward = true,              -- G: keep 1/G for the backward, regathered in groups of G (hpZ)
--     compute_copy = nil,                        -- bf16 copies of the masters, written by AdamW (see below)
--     compress = { grads = "int8", block = 256 },  -- or "topk" + density: compressed reduction (fsdp.compress)
--   })
--   local logits, loss = model(x, y)             -- the model is used as before
--   loss:backward()                              -- gathers, reduce-scatters as it goes
--   sharded:clip_grad_norm(1.0); opt:step(); sharded:zero_grad()
--   sharded:set_prefetch("h.0", { forward = { "h.1", "h.2" } })   -- FSDP2's explicit prefetch lists
--   local h = sharded:unshard("h.0", { async = true }); h:wait()  -- gather on request
--
-- A wrap policy picks the modules that become units; the root unit (the
-- model) takes every parameter no other unit claimed. Each unit's parameters
-- live in the C schedule (engine/distributed/sched.c): this rank holds 1/N of them,
-- and the module fields become views of the unit's gathered buffer. The
-- model should not be materialized: each rank initializes only its shard,
-- from (seed, parameter path, element index), so the values equal the
-- unsharded init. A materialized model is accepted too (its values are
-- copied into the shards and its tensors dropped).
--
-- A module marked with _slice_rows (GPT's tied embedding under head_chunk)
-- gets its trainable weight in a sliced unit of its own (sched.c): the
-- chunked ops (fsdp.chunked_cross_entropy, fsdp.chunked_embedding) gather
-- it a chunk of rows at a time and reduce-scatter each chunk's gradient at
-- once, so neither the table nor its gradient is ever whole on a rank, and
-- it is not held gathered through the blocks' backward. Not with offload
-- (it stays with its unit then).
--
-- Frozen parameters (module:requires_grad(false) or t:requires_grad(false),
-- before fsdp.shard or after it, before the optimizer is made) go into a
-- second, frozen unit beside their module's trainable one: gathered like
-- any other, but with no gradient shard, no flat gradient, no
-- reduce-scatter, and left out of param_groups()/parameters(), so no
-- optimizer state, update or weight decay either. Freezing after the
-- optimizer was made is an error at the next forward.
--
-- offload = true keeps the f32 master and gradient shards in host memory
-- while the model computes on the GPU: the optimizer made over
-- sharded:parameters() then keeps its state there too and steps on the CPU.
-- Each gather copies this rank's shard to the GPU first, each reduced
-- gradient shard comes back (PyTorch's CPUOffload(offload_params=True)).
-- Where the compute device is the CPU it changes nothing.
--
-- compute_copy: with a bf16 compute dtype each unit keeps its f32 master
-- shard's values in bf16 beside it (2 bytes per parameter per shard);
-- AdamW writes them as it updates the masters, and the gathers send them
-- instead of casting the masters at every forward and backward (on one
-- rank the unit's buffer is the copy itself). Any other write into a
-- master (a load, an import, a user's copy, another optimizer) leaves its
-- copy stale and the next gather casts it again. nil (the default): kept
-- unless the shards are offloaded; true keeps them in host memory there
-- too; false: cast at each gather. Ignored with f32 compute.
--
-- On a world of one (one rank, f32 compute and reduction, shards where the
-- model computes) the unit buffers are the parameters themselves: module
-- fields are views of the master, gradients land in the gradient shard,
-- nothing is gathered or copied, and memory is that of the unsharded model.
local ffi = require "ffi"
local fsdp = require "fsdp"
local core = require "fsdp.core"
local dist = require "fsdp.distributed"
local options = require "fsdp.options"
local optim = require "fsdp.optim"
local Module = require "fsdp.nn.module"
local init = Module.init

local C = core.C
local raise = core.raise

local M = {}
local policy = require "fsdp.policy"
M.policy = policy
M.why_not_unit = policy.why_not_unit

local function numel_of(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

--- Splits model into units. Returns a list (root first) of
-- { path=, module=, params = { {path, module, name, shape, init, tensor, numel}, ... }, numel= }.
-- Shared modules are flattened once; sharing across units is an error.
function M.assign_units(model, wrap)
  wrap = wrap or policy.none()
  if type(wrap) ~= "function" then
    error("fsdp.shard: policy must be a function(module, path) -> boolean, got " .. type(wrap), 3)
  end
  local owner = {}      -- module -> unit
  local seen_at = {}    -- module -> first path
  local units = {}
  local root = { path = "", module = model, params = {}, numel = 0 }

  -- post-order: children decide first, so by_size sees what is left
  local function visit(m, path)
    if seen_at[m] then return 0, true end
    seen_at[m] = path
    local unclaimed = 0
    for _, cn in ipairs(m._child_names) do
      local child = m[cn]
      local n = visit(child, path == "" and cn or path .. "." .. cn)
      unclaimed = unclaimed + n
    end
    for _, pn in ipairs(m._param_names) do unclaimed = unclaimed + numel_of(m._param_specs[pn].shape) end
    if m ~= model then
      local decision = wrap(m, path, unclaimed)
      if type(decision) ~= "boolean" then
        error(string.format("fsdp.shard: the wrap policy returned %s (a %s) for '%s' (%s); expected true or false",
          tostring(decision), type(decision), path, m.__name), 0)
      end
      if decision then
        local why = M.why_not_unit(m)
        if why then
          error(string.format("fsdp.shard: the wrap policy selected '%s' (%s), which cannot be a unit: %s", path,
            m.__name, why), 0)
        end
        local u = { path = path, module = m, params = {}, numel = 0 }
        units[#units + 1] = u
        owner[m] = u
        return 0
      end
    end
    return unclaimed
  end
  visit(model, "")

  -- each parameter goes to its nearest enclosing unit (the root by default)
  local placed = {}     -- "module/name" key -> { unit, path }
  local function place(m, path, unit)
    unit = owner[m] or unit
    for _, pn in ipairs(m._param_names) do
      local key = m
      placed[key] = placed[key] or {}
      local ppath = path == "" and pn or path .. "." .. pn
      local prior = placed[key][pn]
      if prior then
        if prior.unit ~= unit then
          error(string.format("fsdp.shard: parameter '%s' is shared with '%s', which belongs to another unit ('%s'); "
            .. "shared parameters must live in one unit (wrap their common parent instead)", ppath, prior.path,
            prior.unit.path == "" and "root" or prior.unit.path), 0)
        end
      else
        local spec = m._param_specs[pn]
        local t = m[pn]
        local p = { path = ppath, module = m, name = pn, shape = spec.shape, init = spec.init, tensor = t,
          numel = numel_of(spec.shape), frozen = spec.frozen == true or (fsdp.is_tensor(t) and not t:requires_grad()) }
        unit.params[#unit.params + 1] = p
        unit.numel = unit.numel + p.numel
        placed[key][pn] = { unit = unit, path = ppath }
      end
    end
    for _, cn in ipairs(m._child_names) do
      place(m[cn], path == "" and cn or path .. "." .. cn, unit)
    end
  end
  place(model, "", root)
  table.sort(units, function(a, b) return a.path < b.path end)
  table.insert(units, 1, root)
  return units
end

-- ---- communicators for a strategy ----

local comm_box = ffi.new("fsdp_comm *[1]")
local int2 = ffi.new("int[2]")

-- The world as fsdp.distributed sees it (a dry run's counting world under
-- fsdp.plan); its group keeps the handle.
local function world_comm()
  return dist.world_group().comm
end

-- A split computed alike on every rank: color_of(r) -> color, key.
local function split_by(parent, size, color_of)
  local colors, keys = ffi.new("int[?]", size), ffi.new("int[?]", size)
  for r = 0, size - 1 do colors[r], keys[r] = color_of(r) end
  if C.fsdp_comm_split_all(comm_box, parent, colors, keys, size) ~= 0 then raise() end
  return ffi.gc(comm_box[0], C.fsdp_comm_free)
end

local function comm_info(c)
  if C.fsdp_comm_info(c, int2, int2 + 1) ~= 0 then raise() end
  return int2[0], int2[1]
end

M.strategies = { full_shard = true, shard_grad_op = true, no_shard = true, hybrid_shard = true }

--- shard and replica communicators (replica nil when there is none).
local function make_comms(strategy, group_size)
  local world = world_comm()
  local rank, size = comm_info(world)
  if strategy == "full_shard" or strategy == "shard_grad_op" then return world, nil, world end
  if strategy == "no_shard" then
    return split_by(world, size, function(r) return r, 0 end), (size > 1 and world or nil), world
  end
  -- hybrid: shard inside consecutive groups of G ranks, replicate across them
  local G = group_size
  if type(G) ~= "number" or G < 1 or G ~= math.floor(G) then
    error("fsdp.shard: hybrid_shard needs group_size, a positive integer (got " .. tostring(G) .. ")", 0)
  end
  if size % G ~= 0 then
    error(string.format("fsdp.shard: hybrid_shard group_size %d does not divide the world size %d (rank %d)", G,
      size, rank), 0)
  end
  local shard = split_by(world, size, function(r) return math.floor(r / G), r end)
  local replica = split_by(world, size, function(r) return r % G, r end)
  return shard, replica, world
end

--- reshard_after_forward (FSDP2): true (the default) frees each unit after
-- its forward; an integer G (ZeRO++ hpZ) keeps this rank's 1/G of it over
-- a group of G consecutive ranks of the shard group, so that the backward
-- regathers within that group (a node, say) instead of the whole shard
-- group: padded / G more elements per unit held from forward to backward,
-- the same bytes gathered, over fewer ranks. false is G = 1 (a whole copy
-- kept: no gather in backward, as shard_grad_op). G must divide the shard
-- group's size; G equal to it is the default. full_shard and hybrid_shard.
-- Returns the group's communicator, or nil for the default.
function M._reshard_group(v, strategy, shard_comm, rank)
  if v == nil or v == true then return nil end
  local srank, N = comm_info(shard_comm)
  local G = v == false and 1 or v
  if type(G) ~= "number" or G < 1 or G ~= math.floor(G) then
    error(string.format("fsdp.shard: reshard_after_forward must be true, false or a group size (a positive "
      .. "integer), got %s (rank %d)", tostring(v), rank), 0)
  end
  if strategy ~= "full_shard" and strategy ~= "hybrid_shard" then
    error(string.format("fsdp.shard: reshard_after_forward %s applies to full_shard and hybrid_shard, not %s "
      .. "(rank %d)", tostring(v), strategy, rank), 0)
  end
  if N % G ~= 0 then
    error(string.format("fsdp.shard: reshard_after_forward group size %d does not divide the shard group of %d "
      .. "ranks (rank %d)", G, N, rank), 0)
  end
  if G == N then return nil end
  return split_by(shard_comm, N, function(r) return math.floor(r / G), r end)
end

-- A 52-bit hash of a string, exact as a double.
local function hash52(s)
  local h = 0
  for i = 1, #s do h = (h * 31 + s:byte(i)) % 4503599627370449 end
  return h
end

-- All ranks must build the same model: compare a fingerprint of the unit
-- layout (paths and shapes): its maximum and minimum over ranks.
local function check_same_model(group, units, rank)
  local parts = {}
  for _, u in ipairs(units) do
    parts[#parts + 1] = "[" .. u.path .. "]"
    for _, p in ipairs(u.params) do
      parts[#parts + 1] = p.path .. "(" .. table.concat(p.shape, "x") .. ")" .. (p.frozen and "*" or "")
    end
  end
  local h = hash52(table.concat(parts, ";"))
  local hi, lo = group:max(h), group:min(h)
  if hi ~= h or lo ~= h then
    error(string.format("fsdp.shard: ranks disagree on the model (rank %d's layout fingerprint is %.0f, others "
      .. "differ: %d units, %d tensors here); every rank must build the same model and policy", rank, h, #units,
      #parts - #units), 0)
  end
end

-- ---- the sharded model ----

local Sharded = {}
Sharded.__index = Sharded

--- print(sharded): the wrapped module tree, each unit marked (fsdp.shard_print)
Sharded.__tostring = function(self) return require("fsdp.shard_print")(self) end

local dtypes = { f32 = 0, bf16 = 1 }
local prefetch_ids = { none = 0, backward_pre = 1, backward_post = 2 }

local sched_box = ffi.new("fsdp_sched *[1]")
local i64s = ffi.new("int64_t[4]")
local out = core.out
local wrap_t = core.wrap

-- The options fsdp.shard takes (a typo is an error naming the closest one).
M.option_names = { "policy", "strategy", "group_size", "mixed_precision", "prefetch", "forward_prefetch", "limit",
  "seed", "offload", "reshard_after_forward", "compute_copy", "compress" }
local mixed_precision_names = { "compute", "reduce", "param" }

--- fsdp.shard(model, opts) -> Sharded (see the top of this file).
function M.shard(model, opts)
  opts = opts or {}
  if type(model) ~= "table" or not model._param_names then error("fsdp.shard: expected an nn module", 2) end
  if type(opts) ~= "table" then error("fsdp.shard: options must be a table, got " .. type(opts), 2) end
  options.check_keys(opts, M.option_names, "fsdp.shard", 2)
  if opts.mixed_precision ~= nil then
    if type(opts.mixed_precision) ~= "table" then
      error("fsdp.shard: mixed_precision must be a table { compute =, reduce = }, got "
        .. type(opts.mixed_precision), 2)
    end
    options.check_keys(opts.mixed_precision, mixed_precision_names, "fsdp.shard: mixed_precision", 2)
  end
  local strategy = opts.strategy or "full_shard"
  if not M.strategies[strategy] then
    error("fsdp.shard: unknown strategy '" .. tostring(strategy) ..
      "' (expected full_shard, shard_grad_op, no_shard or hybrid_shard)", 2)
  end
  local mp = opts.mixed_precision or {}
  local compute, reduce = mp.compute or mp.param or "f32", mp.reduce or mp.compute or mp.param or "f32"
  if not dtypes[compute] or not dtypes[reduce] then
    error(string.format("fsdp.shard: mixed_precision compute '%s' / reduce '%s' must be f32 or bf16",
      tostring(compute), tostring(reduce)), 2)
  end
  local prefetch = opts.prefetch == nil and "backward_pre" or (opts.prefetch or "none")
  if prefetch_ids[prefetch] == nil then
    error("fsdp.shard: prefetch must be backward_pre, backward_post or none, got " .. tostring(prefetch), 2)
  end
  local limit = opts.limit or 2
  if opts.offload ~= nil and type(opts.offload) ~= "boolean" then
    error("fsdp.shard: offload must be true or false, got " .. tostring(opts.offload), 2)
  end
  if opts.compute_copy ~= nil and type(opts.compute_copy) ~= "boolean" then
    error("fsdp.shard: compute_copy must be true, false or nil (automatic), got " .. tostring(opts.compute_copy), 2)
  end
  local compress = require("fsdp.compress").parse(opts.compress, strategy, opts.offload == true, 2)
  local groups = M.assign_units(model, opts.policy)
  local shard_comm, replica_comm, world = make_comms(strategy, opts.group_size)
  local rank = comm_info(world)
  local group, shard_group = dist._borrow(world), dist._borrow(shard_comm)
  check_same_model(group, groups, rank)
  local reshard_comm = M._reshard_group(opts.reshard_after_forward, strategy, shard_comm, rank)
  -- offload moves the shards off a GPU: a no-op where the CPU computes (or
  -- the counting device stands for it)
  local device = fsdp.default_device()
  local offload = opts.offload == true and device ~= "cpu" and
    not (device == "meta" and require("fsdp.meta").mimicked() == "cpu")
  -- a world of one is not a special case for the caller, only for the
  -- engine: parameters become views of the master, nothing is gathered
  -- (so is a shard group of one with replicas, no_shard: the gradient
  -- shards are then all-reduced in place, 16 bytes per parameter as DDP)
  local direct = shard_group:size() == 1 and compute == "f32" and reduce == "f32" and not offload and
      os.getenv("FSDP_FORCE_COLLECTIVES") ~= "1"   -- the engine's switch to exercise the communicator on one rank
  local self = setmetatable({
    model = model, strategy = strategy, compute = compute, reduce = reduce,
    offload = offload, direct = direct, compress = compress,
    -- the engine's FSDP_COPY_*: automatic unless asked (f32 compute has no copy to keep)
    copy_mode = compute == "f32" and 2 or opts.compute_copy == nil and 2 or opts.compute_copy and 1 or 0,
    shard_comm = shard_comm, replica_comm = replica_comm,
    world = world, rank = rank,
    group = group, shard_group = shard_group,   -- fsdp.distributed groups: every rank, and the shard group
    sched_args = { dtypes[compute], dtypes[reduce], prefetch_ids[prefetch],
                   opts.forward_prefetch ~= false and 1 or 0, limit },   -- forward prefetch on unless false
    seed = opts.seed or 0, optimizer_made = false, reshard_comm = reshard_comm,
  }, Sharded)
  self:_build(groups)
  -- only now, with every unit built and initialized, does the model change:
  -- a failure above leaves it as it was
  for k = 2, #groups do self:_wrap_forward(groups[k].module) end
  self:_wrap_forward(model, true)
  return self
end

-- Builds the schedule for the module units of assign_units (root first):
-- each becomes one schedule unit of its trainable parameters and, when it
-- has frozen ones, a second, frozen unit of those (no gradient shard, no
-- reduce-scatter); the root's trainable unit exists even when empty (its
-- hooks start and finish each step). self.units lists them, in that order.
-- Values come from each parameter's p.tensor when set, else from its init
-- rule. A failure leaves self as it was.
function Sharded:_build(groups)
  local a = self.sched_args
  if C.fsdp_sched_new(sched_box, self.shard_comm, self.replica_comm, a[1], a[2], a[3], a[4], a[5]) ~= 0 then
    raise()
  end
  local sched = ffi.gc(sched_box[0], C.fsdp_sched_free)
  if self.offload and C.fsdp_sched_set_shard_device(sched, core.device_id("cpu")) ~= 0 then raise() end
  if self.direct and C.fsdp_sched_set_direct(sched, 1) ~= 0 then raise() end
  if C.fsdp_sched_set_compute_copy(sched, self.copy_mode) ~= 0 then raise() end
  require("fsdp.compress").apply(sched, self.compress, self.direct)
  if self.reshard_comm and C.fsdp_sched_set_reshard_group(sched, self.reshard_comm) ~= 0 then raise() end
  local built = { sched = sched, units = {}, grads = {}, segments = {}, parts_of = {}, groups = groups }
  local keep_all = self.strategy == "shard_grad_op"
  for k, g in ipairs(groups) do
    local trainable, frozen = {}, {}
    for _, p in ipairs(g.params) do
      local list = p.frozen and frozen or trainable
      list[#list + 1] = p
    end
    -- a table read by vocabulary chunks (GPT's head_chunk): a sliced unit of its own,
    -- gathered and reduced a chunk at a time, never with the root
    local sliced = {}
    for i = #trainable, 1, -1 do
      local p = trainable[i]
      if p.module._slice_rows and p.name == "weight" and #p.shape == 2 and not self.offload then
        table.remove(trainable, i)
        sliced[#sliced + 1] = { params = { p }, frozen = false, sliced = true, name = p.path }
      end
    end
    local base = g.path == "" and "root" or g.path
    local parts = {}
    if k == 1 or #trainable > 0 then parts[#parts + 1] = { params = trainable, frozen = false, name = base } end
    if #frozen > 0 then parts[#parts + 1] = { params = frozen, frozen = true, name = base .. "[frozen]" } end
    for _, u in ipairs(sliced) do parts[#parts + 1] = u end
    built.parts_of[g.module] = {}
    for pi, u in ipairs(parts) do
      u.path, u.module, u.numel = g.path, g.module, 0
      for _, p in ipairs(u.params) do u.numel = u.numel + p.numel end
      local n = #u.params
      local numels = ffi.new("int64_t[?]", math.max(n, 1))
      for i, p in ipairs(u.params) do numels[i - 1] = p.numel end
      local idx = ffi.new("int[1]")
      if u.sliced then
        if C.fsdp_sched_add_sliced_unit(sched, u.name, u.numel, u.params[1].shape[2], idx) ~= 0 then raise() end
      elseif C.fsdp_sched_add_unit(sched, u.name, n, numels, (k == 1 or keep_all) and 1 or 0, idx) ~= 0 then
        raise()
      end
      u.index = idx[0]
      if u.frozen and C.fsdp_unit_set_frozen(sched, u.index, pi > 1 and parts[1].index or -1) ~= 0 then raise() end
      if C.fsdp_unit_info(sched, u.index, i64s, i64s + 1, i64s + 2, i64s + 3) ~= 0 then raise() end
      u.padded, u.shard_numel, u.shard_offset = tonumber(i64s[1]), tonumber(i64s[2]), tonumber(i64s[3])
      local mbox, gbox = ffi.new("fsdp_tensor *[1]"), ffi.new("fsdp_tensor *[1]")
      if C.fsdp_unit_shard(sched, u.index, mbox, gbox) ~= 0 then raise() end
      u.master = ffi.gc(mbox[0], C.fsdp_tensor_release)
      if not u.frozen then
        u.grad = ffi.gc(gbox[0], C.fsdp_tensor_release)
        built.grads[#built.grads + 1] = u.grad
      end
      self:_init_unit(u, built.segments)
      built.units[#built.units + 1] = u
      if not u.sliced then   -- a sliced unit has no forward hooks: the chunked ops gather it
        local list = built.parts_of[g.module]
        list[#list + 1] = u.index
      end
    end
  end
  for _, u in ipairs(built.units) do self:_bind_views(u, sched) end
  for k, v in pairs(built) do self[k] = v end
  if self.prefetch_lists then self:_apply_prefetch() end   -- (a rebuild after freezing keeps them)
end

-- Parameters frozen or unfrozen since the schedule was built (by
-- requires_grad on their views) move between the trainable and frozen
-- units: the schedule is rebuilt with the current values, module by module.
-- Refused once an optimizer was made over the shards: it holds them.
function Sharded:_sync_frozen()
  local changed
  for _, u in ipairs(self.units) do
    for _, p in ipairs(u.params) do
      local now = not p.module[p.name]:requires_grad()
      if now ~= u.frozen then
        changed = changed or p
        p.frozen = now
        p.module._param_specs[p.name].frozen = now
      end
    end
  end
  if not changed then return end
  if self.optimizer_made then
    error(string.format("fsdp.shard: parameter '%s' was %s after the optimizer was made over this model's shards "
      .. "(rank %d); set requires_grad before calling param_groups() or parameters()", changed.path,
      changed.frozen and "frozen" or "unfrozen", self.rank), 0)
  end
  check_same_model(self.group, self.groups, self.rank)
  -- current values: each module unit's parts gathered in f32, as the new parameters' sources
  local old_units = self.units
  local function gathered(u)
    local full = fsdp.empty({ u.padded }, { dtype = "f32", tag = "comm", device = u.master:device() })
    if C.fsdp_all_gather(nil, self.shard_comm, full, u.master, u.name) ~= 0 then raise() end
    return full
  end
  fsdp.no_grad(function()
    for _, u in ipairs(old_units) do
      local full = gathered(u)
      for i, p in ipairs(u.params) do p.tensor = full:narrow(1, u.offsets[i] + 1, p.numel) end
    end
  end)
  local ok, err = pcall(self._build, self, self.groups)
  for _, u in ipairs(old_units) do
    for _, p in ipairs(u.params) do p.tensor = nil end
  end
  if not ok then error(err, 0) end
end

-- Fills this rank's slice of every parameter of unit u: from the model's
-- own tensors when it was materialized, else from the init rule.
function Sharded:_init_unit(u, segments)
  local seed = self.seed
  local lo, hi = u.shard_offset, u.shard_offset + u.shard_numel
  local off = 0
  u.offsets = {}
  for _, p in ipairs(u.params) do
    u.offsets[#u.offsets + 1] = off
    local a, b = math.max(lo, off), math.min(hi, off + p.numel)
    if a < b then
      local dst = u.master:narrow(1, a - lo + 1, b - a)
      if p.tensor then
        dst:copy(p.tensor:detach():contiguous():view(-1):narrow(1, a - off + 1, b - a))
      else
        init.fill(dst, p.init, seed, p.path, a - off)
      end
      -- the optimizer's view of this slice, with its gradient slice (none when frozen)
      local g = u.grad and u.grad:narrow(1, a - lo + 1, b - a)
      if g then dst:set_grad(g) end
      segments[#segments + 1] = { tensor = dst, grad = g, dims = #p.shape, path = p.path, frozen = u.frozen }
    end
    off = off + p.numel
  end
end

-- Module fields become views of the unit's gathered buffer.
function Sharded:_bind_views(u, sched)
  for i, p in ipairs(u.params) do
    local nd = #p.shape
    local shape = ffi.new("int64_t[?]", math.max(nd, 1))
    for d = 1, nd do shape[d - 1] = p.shape[d] end
    if C.fsdp_unit_param(sched, u.index, i - 1, nd, shape, out) ~= 0 then raise() end
    p.module[p.name] = wrap_t()
    p.tensor = nil
  end
end

local recompute = require "fsdp.nn.recompute"
local function pack(...) return { n = select("#", ...), ... } end
local recompute_modes = { none = 0, forward = 1, replay = 2 }

-- A module unit's forward runs between the pre- and post-forward hooks of
-- its schedule units (trainable, then frozen; closed in reverse). The root
-- first applies freezing changes made since the last step.
function Sharded:_wrap_forward(m, is_root)
  local inner = m.forward
  m.forward = function(mod, ...)
    if is_root then self:_sync_frozen() end
    local sched, idx = self.sched, self.parts_of[m]
    if C.fsdp_sched_set_recompute(sched, recompute_modes[recompute.phase or "none"]) ~= 0 then raise() end
    for i = 1, #idx do
      if C.fsdp_unit_pre_forward(sched, idx[i]) ~= 0 then raise() end
    end
    local res = pack(pcall(inner, mod, ...))   -- (a forward may return nil, loss)
    if not res[1] then error(res[2], 0) end
    for i = #idx, 1, -1 do
      if C.fsdp_unit_post_forward(sched, idx[i]) ~= 0 then raise() end
    end
    return unpack(res, 2, res.n)
  end
end

function Sharded:__call(...) return self.model(...) end

--- Parameter groups for an optimizer over this rank's shard slices, with
-- weight decay on matrices and embeddings only.
-- The two groups are there on every rank, in this order, even when this
-- rank's slices leave one empty: ranks then agree on group hyperparameters
-- (and a checkpoint's groups mean the same on every rank count).
-- Each group's zero_grad hook (fsdp.optim calls it instead of dropping the
-- slices' gradients, which are views of the persistent gradient shards).
-- Frozen parameters are in neither: no state, no update, no decay.
function Sharded:param_groups(weight_decay)
  self:_sync_frozen()
  self.optimizer_made = true
  local decay, other = {}, {}
  for _, s in ipairs(self.segments) do
    if s.frozen then
    elseif s.dims >= 2 then decay[#decay + 1] = s.tensor else other[#other + 1] = s.tensor end
  end
  local function zero() self:zero_grad() end
  return { { params = decay, weight_decay = weight_decay or 0, zero_grad = zero },
    { params = other, weight_decay = 0, zero_grad = zero } }
end

--- Every shard slice (for an optimizer without groups), with the same
-- zero_grad hook.
function Sharded:parameters()
  self:_sync_frozen()
  self.optimizer_made = true
  local ps = { zero_grad = function() self:zero_grad() end }
  for _, s in ipairs(self.segments) do
    if not s.frozen then ps[#ps + 1] = s.tensor end
  end
  return ps
end

--- Zeroes the gradient shards, and drops full gradients kept by no_sync.
function Sharded:zero_grad()
  if C.fsdp_sched_zero_grad(self.sched) ~= 0 then raise() end
end

--- Global gradient norm over all shards (an all-reduce over the shard group).
local sumsq_box = ffi.new("double[1]")
function Sharded:grad_norm()
  local n = #self.grads
  local grads = ffi.new("fsdp_tensor *[?]", n > 0 and n or 1)
  for i, g in ipairs(self.grads) do grads[i - 1] = g end
  if C.fsdp_sumsq_many(grads, n, sumsq_box) ~= 0 then raise() end   -- one pass, one wait
  self.local_grad_sumsq = sumsq_box[0]   -- this rank's part (fsdp.guard names the rank it is not finite on)
  return math.sqrt(self.shard_group:sum(sumsq_box[0]))
end

--- Scales the gradient shards so that the global norm is at most max_norm
-- (optim.clip_coef's factor); returns the norm before clipping. Collective.
function Sharded:clip_grad_norm(max_norm)
  local norm = self:grad_norm()
  local coef = optim.clip_coef(norm, max_norm, "Sharded:clip_grad_norm")
  if coef < 1 then
    for _, g in ipairs(self.grads) do
      if C.fsdp_scale_(g, coef) ~= 0 then raise() end
    end
  end
  return norm
end

--- Gradient accumulation without communication: fn runs forward and
-- backward(s) whose gradients stay local until a backward outside no_sync.
function Sharded:no_sync(fn, ...)
  if C.fsdp_sched_set_sync(self.sched, 0) ~= 0 then raise() end
  local res = { pcall(fn, ...) }
  C.fsdp_sched_set_sync(self.sched, 1)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2)
end

--- Runs fn with every unit gathered (parameters readable as full tensors),
-- then writes this rank's slice of each parameter back into its master
-- shard (what fn changed persists, as FSDP1's writeback=True) and
-- reshards. sharded:summon_full_params({ writeback = false }, fn, ...)
-- discards changes. Collective: every rank must call it, and writes must be
-- the same on every rank (each keeps only its own slice). With a bf16
-- compute dtype the written values are bf16-rounded.
local summon_option_names = { "writeback" }
function Sharded:summon_full_params(a, ...)
  local writeback, fn = true, a
  local args = { n = select("#", ...), ... }
  if type(a) == "table" then
    options.check_keys(a, summon_option_names, "summon_full_params", 2)
    if a.writeback ~= nil and type(a.writeback) ~= "boolean" then
      error("summon_full_params: writeback must be true or false, got " .. tostring(a.writeback), 2)
    end
    writeback = a.writeback ~= false
    fn = args[1]
    args = { n = args.n - 1, unpack(args, 2, args.n) }
  end
  if type(fn) ~= "function" then error("summon_full_params: expected a function, got " .. type(fn), 2) end
  for _, u in ipairs(self.units) do
    if C.fsdp_unit_unshard(self.sched, u.index) ~= 0 then raise() end
  end
  -- a world of one: the parameters are the masters; discarding needs a copy
  local saved = {}
  if self.direct and not writeback then
    fsdp.no_grad(function()
      for k, u in ipairs(self.units) do saved[k] = u.master:clone() end
    end)
  end
  local res = { pcall(fn, unpack(args, 1, args.n)) }
  if #saved > 0 then
    fsdp.no_grad(function()
      for k, u in ipairs(self.units) do u.master:copy(saved[k]) end
    end)
  end
  if res[1] and writeback and not self.direct then
    local ok, err = pcall(fsdp.no_grad, function()
      for _, u in ipairs(self.units) do
        local lo, hi = u.shard_offset, u.shard_offset + u.shard_numel
        for i, p in ipairs(u.params) do
          local off = u.offsets[i]
          local x, y = math.max(lo, off), math.min(hi, off + p.numel)
          if x < y then
            local full = p.module[p.name]:detach():view(-1)
            u.master:narrow(1, x - lo + 1, y - x):copy(full:narrow(1, x - off + 1, y - x))
          end
        end
      end
    end)
    if not ok then res = { false, err } end
  end
  for _, u in ipairs(self.units) do C.fsdp_unit_reshard(self.sched, u.index) end
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2)
end

--- {path = full f32 tensor}: the masters (not the compute-dtype copies),
-- all-gathered unit by unit; every rank gets them, for evaluation or export
-- of small models (large ones: fsdp.checkpoint.export streams instead).
function Sharded:full_state_dict()
  return fsdp.no_grad(function()
    local sd = {}
    for _, u in ipairs(self.units) do
      local full = fsdp.empty({ u.padded }, { dtype = "f32", device = u.master:device() })
      if C.fsdp_all_gather(nil, self.shard_comm, full, u.master, u.name) ~= 0 then raise() end
      for i, p in ipairs(u.params) do
        sd[p.path] = full:narrow(1, u.offsets[i] + 1, p.numel):contiguous():view(p.shape)
      end
    end
    return sd
  end)
end

--- Traffic and memory of this rank since the last call (reset after).
local stat_i64, stat_dbl = ffi.new("int64_t[2]"), ffi.new("double[1]")
function Sharded:step_stats()
  if C.fsdp_comm_stats(stat_i64, stat_i64 + 1, stat_dbl) ~= 0 then raise() end
  local s = { gathered_bytes = tonumber(stat_i64[0]), reduced_bytes = tonumber(stat_i64[1]),
    wait_seconds = stat_dbl[0] }
  if C.fsdp_comm_wire_stats(stat_i64, stat_i64 + 1) ~= 0 then raise() end
  s.wire_gathered_bytes, s.wire_reduced_bytes = tonumber(stat_i64[0]), tonumber(stat_i64[1])
  C.fsdp_comm_reset_stats()
  return s
end

--- The compute copy of unit u (an entry of sharded.units) as it is now: the
-- bf16 tensor of its master shard's values (nil when it keeps none, or none
-- was made yet) and whether it holds the master's present values (else the
-- next gather casts it again).
local current_box = ffi.new("int[1]")
function Sharded:compute_copy(u)
  if C.fsdp_unit_compute_copy(self.sched, u.index, out, current_box) ~= 0 then raise() end
  local copy = core.wrap_or_nil()
  return copy, current_box[0] == 1
end

--- The same statistics combined over ranks: the maximum of each, and the
-- peak memory per tag as the maximum over ranks.
function Sharded:global_stats()
  local s = self:step_stats()
  local mem = fsdp.memory.all()
  local names = { "param", "grad", "optimizer", "activation", "comm", "other" }
  local vals = { s.gathered_bytes, s.reduced_bytes, s.wait_seconds }
  for i, n in ipairs(names) do vals[3 + i] = mem[n].peak end
  vals[#vals + 1], vals[#vals + 2] = s.wire_gathered_bytes, s.wire_reduced_bytes
  vals = self.group:max(vals)
  local g = { gathered_bytes = vals[1], reduced_bytes = vals[2], wait_seconds = vals[3], peak = {},
    wire_gathered_bytes = vals[#vals - 1], wire_reduced_bytes = vals[#vals] }
  for i, n in ipairs(names) do g.peak[n] = vals[3 + i] end
  return g
end

-- ---- FSDP2 controls: explicit prefetch, unshard on request ----

-- Schedule indices of the unit named name ("root", or a wrapped module's
-- path as sharded:describe() lists it): its trainable part, then its
-- frozen one. An unknown name is an error naming the units there are.
function Sharded:_unit_indices(name, what)
  for _, g in ipairs(self.groups) do
    if (g.path == "" and "root" or g.path) == name then return self.parts_of[g.module] end
  end
  local names = {}
  for _, g in ipairs(self.groups) do names[#names + 1] = g.path == "" and "root" or g.path end
  error(string.format("%s: no unit named '%s' (rank %d; the units are %s)", what, tostring(name), self.rank,
    table.concat(names, ", ")), 3)
end

local phases = { forward = 0, backward = 1 }

function Sharded:_apply_prefetch()
  for name, spec in pairs(self.prefetch_lists) do
    for phase, id in pairs(phases) do
      local list = spec[phase]
      local idx = self:_unit_indices(name, "sharded:set_prefetch")
      local n, arr = -1, nil
      if list then
        local ids = {}
        for _, other in ipairs(list) do ids[#ids + 1] = self:_unit_indices(other, "sharded:set_prefetch")[1] end
        n, arr = #ids, ffi.new("int[?]", math.max(#ids, 1), ids)
      end
      for _, k in ipairs(idx) do
        if C.fsdp_unit_set_prefetch(self.sched, k, id, n, arr) ~= 0 then raise() end
      end
    end
  end
end

--- sharded:set_prefetch(unit, { forward = {units}, backward = {units} }):
-- when unit's forward (backward) starts, the listed units are gathered, in
-- that order, instead of the next one in the last forward's order (FSDP2's
-- set_modules_to_forward_prefetch / set_modules_to_backward_prefetch), with
-- no regard to the gather limit: prefetching two blocks ahead trades one
-- more gathered block for an earlier start of its gather. Units are named
-- as sharded:describe() lists them ("root", "h.0", ...). {} prefetches
-- nothing; false restores the default; a phase left out stays as it was.
-- Call it alike on every rank (an unknown unit is an error on every rank).
local prefetch_option_names = { "forward", "backward" }
function Sharded:set_prefetch(name, spec)
  local what = "sharded:set_prefetch"
  if type(spec) ~= "table" then error(what .. ": expected { forward = {units}, backward = {units} }, got "
      .. type(spec), 2) end
  options.check_keys(spec, prefetch_option_names, what, 2)
  self:_unit_indices(name, what)
  local cur = self.prefetch_lists and self.prefetch_lists[name] or {}
  local new = { forward = cur.forward, backward = cur.backward }
  for phase in pairs(phases) do
    local list = spec[phase]
    if list == false then
      new[phase] = nil
    elseif list ~= nil then
      if type(list) ~= "table" then
        error(string.format("%s: %s must be a list of unit names or false, got %s", what, phase, type(list)), 2)
      end
      local copy = {}
      for i, other in ipairs(list) do
        self:_unit_indices(other, what)
        if other == name then error(string.format("%s: unit '%s' cannot prefetch itself (%s)", what, name, phase), 2) end
        copy[i] = other
      end
      new[phase] = copy
    end
  end
  self.prefetch_lists = self.prefetch_lists or {}
  self.prefetch_lists[name] = new
  self:_apply_prefetch()
  return self
end

local Unshard = {}
Unshard.__index = Unshard

--- handle:wait(): until the gather is done (then the unit's parameters
-- can be read); twice is fine.
function Unshard:wait()
  if self.waited then return end
  self.waited = true
  for _, k in ipairs(self.indices) do
    if C.fsdp_unit_wait(self.sharded.sched, k) ~= 0 then raise() end
  end
end

--- sharded:unshard(unit, { async = true }) -> handle: gathers the unit now
-- (FSDP2's unshard()); with async the all-gather is only issued and runs
-- while the caller goes on: handle:wait() (or the unit's forward) waits
-- for it. The unit is freed again when its forward ends (the root and
-- shard_grad_op's units: after their backward), or by sharded:reshard(unit).
-- Collective over the shard group: call it alike on every rank.
local unshard_option_names = { "async" }
function Sharded:unshard(name, opts)
  local what = "sharded:unshard"
  opts = opts or {}
  if type(opts) ~= "table" then error(what .. ": options must be a table { async = }, got " .. type(opts), 2) end
  options.check_keys(opts, unshard_option_names, what, 2)
  local idx = self:_unit_indices(name, what)
  for _, k in ipairs(idx) do
    if C.fsdp_unit_unshard_async(self.sched, k) ~= 0 then raise() end
  end
  local h = setmetatable({ sharded = self, indices = idx, waited = false }, Unshard)
  if not opts.async then h:wait() end
  return h
end

--- sharded:reshard(unit): frees the unit's gathered parameters.
function Sharded:reshard(name)
  for _, k in ipairs(self:_unit_indices(name, "sharded:reshard")) do
    if C.fsdp_unit_reshard(self.sched, k) ~= 0 then raise() end
  end
end

--- A one-line description of the units.
function Sharded:describe()
  local lines = {}
  for _, u in ipairs(self.units) do
    lines[#lines + 1] = string.format("  unit %-12s %3d tensors %10d params, shard %d", u.name, #u.params, u.numel,
      u.shard_numel)
  end
  return table.concat(lines, "\n")
end

return M
