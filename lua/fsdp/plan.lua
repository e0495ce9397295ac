-- fsdp.plan: what fsdp.shard would do with a model on N ranks, without
-- allocating anything: the units a wrap policy makes, the memory each rank
-- holds per allocator tag (persistent and at its peak) and the bytes each
-- rank communicates per training step.
--
--   local plan = require "fsdp.plan"
--   local p = plan.plan(nn.GPT(cfg), { policy = fsdp.policy.per_block(), strategy = "full_shard" }, 8)
--   print(plan.format(p))
--   fsdp-lua --plan --world=8 recipes/gpt2.lua --preset=small --wrap=block   -- the same from a recipe
--
-- The options are fsdp.shard's (policy, strategy, group_size,
-- mixed_precision, prefetch, forward_prefetch, limit) plus
-- optimizer_states: f32 state tensors per parameter element (2 = AdamW,
-- the default; 1 = SGD with momentum; 0 = none).
--
-- With offload = true the master and gradient shards and the optimizer
-- state are host memory: the per-tag figures are the compute device's
-- (without them, but with each gather's copy of the shard on the device:
-- 4*shard_n bytes of param while that gather is in flight, when the compute
-- dtype is f32; a bf16 copy is untagged), and `host` holds the rest. It is
-- planned as asked, for the GPU job it describes, also on a machine without
-- a GPU (where fsdp.shard's offload changes nothing).
--
-- How the prediction is made. The shard group has G ranks (G = N for
-- full_shard and shard_grad_op, 1 for no_shard, group_size for
-- hybrid_shard). A unit of n parameter elements is padded to
-- padded = ceil(n/G)*G (at least G) and each rank owns shard_n = padded/G
-- of them. Then the schedule of engine/distributed/sched.c is replayed, allocation
-- by allocation, for the unit build and two training steps (the second one
-- with forward prefetch, which needs the order of a previous forward):
--   param      the f32 master shard (4*shard_n, persistent) and, while a
--              unit is gathered, its full buffer (padded * compute bytes);
--   grad       the f32 gradient shard (4*shard_n, persistent) and, during a
--              unit's backward, its flat gradient (padded * compute bytes).
--              When the reduce dtype equals the compute dtype the
--              reduce-scatter reads the flat gradient itself, which then
--              lives until that collective completes: the prediction
--              assumes the comm thread lags (a work completes only when the
--              main thread waits on it or on a later one), the worst case;
--              grad.peak_if_comm_keeps_up assumes it completes at once;
--   optimizer  optimizer_states * 4 bytes per element of each parameter
--              slice this rank owns (padding excluded; one state tensor per
--              parameter slice, as fsdp.optim allocates them);
--   comm       reduce-scatter outputs (shard_n * reduce bytes), which pile
--              up until the end of backward, plus the comm thread's f32
--              scratch for bf16 reductions (an upper bound: the largest one
--              on top of all outputs).
-- Every allocation is rounded as the engine's caching allocator rounds it
-- (M.round), because its statistics count rounded sizes. The replay
-- assumes every unit's forward runs once per step, in declaration order,
-- with a unit nested inside the unit of an enclosing module (as for GPT).
-- The root stays gathered from forward to backward; with shard_grad_op
-- every unit does; prefetch gathers a unit early only while fewer than
-- `limit` units are gathered. Not modelled: gradient accumulation under
-- Sharded:no_sync (each unit's flat gradient then stays until the
-- synchronizing backward), evaluation, and summon_full_params. A unit whose
-- module has no forward of its own (a ModuleList) is never called by the
-- model, so fsdp.shard would never gather it: plan.warnings says so.
--
-- Traffic per step per rank, as fsdp_comm_stats counts it: all-gather bytes
-- are padded * compute bytes per gather (the full buffer, own block
-- included): every unit once in forward, and again in backward for the
-- units resharded after forward (all but the root for full_shard and
-- hybrid_shard, none for shard_grad_op). Reduced bytes are the
-- reduce-scatter input (padded * reduce bytes per unit) plus, when there
-- are replicas (no_shard, hybrid_shard), the all-reduce of the shard
-- (shard_n * reduce bytes per unit). The engine counts gathers and
-- reduce-scatters on a one-rank shard group too (no_shard), although they
-- are local copies; the "network" figures leave those out.
local M = {}

local dtype_bytes = { f32 = 4, bf16 = 2 }
local prefetch_modes = { none = true, backward_pre = true, backward_post = true }
M.strategies = { full_shard = true, shard_grad_op = true, no_shard = true, hybrid_shard = true }

--- Bytes the engine's allocator reserves (and its statistics count) for a
-- request of n bytes: 64-byte steps up to 4 KiB, then four steps per power
-- of two (engine/core/alloc.c, size_class).
function M.round(n)
  if n <= 0 then n = 1 end
  if n <= 4096 then return math.ceil(n / 64) * 64 end
  local lg = 12
  while 2 ^ (lg + 1) < n do lg = lg + 1 end      -- 2^lg < n <= 2^(lg+1)
  local base = 2 ^ lg
  local step = base / 4
  return base + math.ceil((n - base) / step) * step
end

local function fail(msg) error("fsdp.plan: " .. msg, 0) end

local function check_options(opts, world)
  if type(world) ~= "number" or world < 1 or world ~= math.floor(world) then
    fail("world size must be a positive integer, got " .. tostring(world))
  end
  local strategy = opts.strategy or "full_shard"
  if not M.strategies[strategy] then
    fail("unknown strategy '" .. tostring(strategy) ..
      "' (expected full_shard, shard_grad_op, no_shard or hybrid_shard)")
  end
  local mp = opts.mixed_precision or {}
  local compute = mp.compute or mp.param or "f32"
  local reduce = mp.reduce or mp.compute or mp.param or "f32"
  if not dtype_bytes[compute] or not dtype_bytes[reduce] then
    fail(string.format("mixed_precision compute '%s' / reduce '%s' must be f32 or bf16", tostring(compute),
      tostring(reduce)))
  end
  local prefetch = opts.prefetch == nil and "backward_pre" or (opts.prefetch or "none")
  if not prefetch_modes[prefetch] then
    fail("prefetch must be backward_pre, backward_post or none, got " .. tostring(prefetch))
  end
  local limit = opts.limit or 2
  if type(limit) ~= "number" or limit < 1 then fail("limit must be >= 1, got " .. tostring(limit)) end
  local G
  if strategy == "no_shard" then
    G = 1
  elseif strategy == "hybrid_shard" then
    G = opts.group_size
    if type(G) ~= "number" or G < 1 or G ~= math.floor(G) then
      fail("hybrid_shard needs group_size, a positive integer (got " .. tostring(G) .. ")")
    end
    if world % G ~= 0 then
      fail(string.format("hybrid_shard group_size %d does not divide the world size %d", G, world))
    end
  else
    G = world
  end
  if opts.offload ~= nil and type(opts.offload) ~= "boolean" then
    fail("offload must be true or false, got " .. tostring(opts.offload))
  end
  local states = opts.optimizer_states or 2
  if type(states) ~= "number" or states < 0 or states ~= math.floor(states) then
    fail("optimizer_states must be a non-negative integer, got " .. tostring(states))
  end
  return {
    world = world, strategy = strategy, group_size = G, replicas = world / G, compute = compute, reduce = reduce,
    prefetch = prefetch, forward_prefetch = opts.forward_prefetch and true or false, limit = limit,
    optimizer_states = states, offload = opts.offload == true,
  }
end

-- Units in execution order with their nesting: each unit's parent is the
-- unit of the nearest enclosing module (the root for the outermost ones).
local function execution_tree(model, units)
  local first = {}   -- module -> pre-order position (first visit)
  local n = 0
  model:apply(function(m)
    if not first[m] then
      n = n + 1
      first[m] = n
    end
  end)
  local by_path = {}
  for k, u in ipairs(units) do by_path[u.path] = k end
  local children = {}
  for k = 1, #units do children[k] = {} end
  local parent = { [1] = 0 }
  for k = 2, #units do
    local path, p = units[k].path, 1
    local prefix = path:match("^(.*)%.[^.]*$")
    while prefix do
      if by_path[prefix] then
        p = by_path[prefix]
        break
      end
      prefix = prefix:match("^(.*)%.[^.]*$")
    end
    parent[k] = p
    table.insert(children[p], k)
  end
  for k = 1, #units do
    table.sort(children[k], function(a, b)
      return (first[units[a].module] or 0) < (first[units[b].module] or 0)
    end)
  end
  local events, order, depth = {}, {}, { [1] = 0 }
  local function walk(k)
    events[#events + 1] = { "pre", k }
    order[#order + 1] = k
    for _, c in ipairs(children[k]) do
      depth[c] = depth[k] + 1
      walk(c)
    end
    events[#events + 1] = { "post", k }
  end
  walk(1)
  return events, order, parent, depth
end

-- Replays engine/distributed/sched.c: the unit build, then two training steps.
-- Collectives run in issue order on one comm thread; a work holds its
-- tensors until it completes. With lazy = true a work completes only when
-- the main thread waits on it or on a later one (a comm thread that lags
-- behind compute: the worst case); with lazy = false at once.
local function simulate(cfg, us, events, lazy)
  local cur = { param = 0, grad = 0, comm = 0 }
  local peak = { param = 0, grad = 0, comm = 0 }
  local function alloc(tag, b)
    cur[tag] = cur[tag] + b
    if cur[tag] > peak[tag] then peak[tag] = cur[tag] end
  end
  local function free(tag, b) cur[tag] = cur[tag] - b end

  -- the comm queue: works in issue order, each with what its completion frees
  local queue, done_upto = {}, 0
  local function complete_upto(i)
    while done_upto < i do
      done_upto = done_upto + 1
      local w = queue[done_upto]
      if w.on_done then w.on_done() end
    end
  end
  local function enqueue(on_done)
    queue[#queue + 1] = { on_done = on_done }
    if not lazy then complete_upto(#queue) end
    return #queue
  end

  -- fsdp_sched_add_unit: master, gradient shard, and the full buffer's
  -- storage, allocated once and dropped at once
  for _, u in ipairs(us) do
    if not cfg.offload then   -- (offloaded: host memory)
      alloc("param", u.master_bytes)
      alloc("grad", u.grad_bytes)
    end
    alloc("param", u.full_bytes)
    free("param", u.full_bytes)
  end

  local gathered, gather_work, n_gathered, peak_gathered = {}, {}, 0, 0
  local t                                -- traffic of the current step
  local phase = "forward"
  local function issue(k)
    if gathered[k] then return end
    alloc("param", us[k].full_bytes)
    gathered[k] = true
    if cfg.offload and cfg.compute == "f32" then   -- the shard's copy on the device, held by the gather
      alloc("param", us[k].master_bytes)
      gather_work[k] = enqueue(function() free("param", us[k].master_bytes) end)
    else
      gather_work[k] = enqueue()
    end
    n_gathered = n_gathered + 1
    if n_gathered > peak_gathered then peak_gathered = n_gathered end
    t.gathers[phase] = t.gathers[phase] + 1
    t.gather_bytes = t.gather_bytes + us[k].padded * dtype_bytes[cfg.compute]
  end
  local function wait_gather(k)
    if gather_work[k] then complete_upto(gather_work[k]) end
    gather_work[k] = nil
  end
  local function gather_now(k)
    issue(k)
    wait_gather(k)
  end
  local function reshard(k)
    if not gathered[k] then return end
    wait_gather(k)
    free("param", us[k].full_bytes)
    gathered[k] = false
    n_gathered = n_gathered - 1
  end
  -- the limit counts gathered units that are not kept (the root always is)
  local function prefetch(k)
    if not k or gathered[k] then return end
    local transient = 0
    for j, u in ipairs(us) do
      if gathered[j] and not u.keep then transient = transient + 1 end
    end
    if transient >= cfg.limit then return end
    issue(k)
  end
  local function last_index(list, n, k)
    for i = n, 1, -1 do
      if list[i] == k then return i end
    end
  end

  local fwd_order, n_fwd = {}, 0
  local flat = {}
  for _ = 1, 2 do
    t = { gathers = { forward = 0, backward = 0 }, gather_bytes = 0 }
    -- forward
    phase = "forward"
    local order, tape, fwd_pos = {}, {}, 0
    for _, ev in ipairs(events) do
      local kind, k = ev[1], ev[2]
      if kind == "pre" then
        if k == 1 then
          order, fwd_pos = {}, 0
        end
        gather_now(k)
        if cfg.forward_prefetch then
          local i = last_index(fwd_order, n_fwd, k)
          if i and i < n_fwd then prefetch(fwd_order[i + 1]) end
        end
        fwd_pos = fwd_pos + 1
        fwd_order[fwd_pos] = k
        if fwd_pos > n_fwd then n_fwd = fwd_pos end
        tape[#tape + 1] = { "begin", k }
      else
        order[#order + 1] = k
        tape[#tape + 1] = { "end", k }
        if not us[k].keep then reshard(k) end
      end
    end
    -- backward: the tape in reverse
    phase = "backward"
    local pending = {}
    for i = #tape, 1, -1 do
      local kind, k = tape[i][1], tape[i][2]
      if kind == "end" then            -- before the unit's backward
        gather_now(k)
        -- at most one earlier reduce-scatter still in flight
        if #pending > 1 then complete_upto(pending[#pending - 1]) end
        if not flat[k] then
          alloc("grad", us[k].flat_bytes)
          flat[k] = true
        end
        if cfg.prefetch == "backward_pre" then
          local j = last_index(order, #order, k)
          if j and j > 1 then prefetch(order[j - 1]) end
        end
      else                             -- its gradients are complete
        alloc("comm", us[k].reduced_bytes)
        local fb = us[k].flat_bytes
        flat[k] = nil
        if cfg.compute == cfg.reduce then
          -- the reduce-scatter reads the flat gradient itself and holds it
          pending[#pending + 1] = enqueue(function() free("grad", fb) end)
        else
          -- it reads a converted copy (activation tag): the flat gradient goes now
          pending[#pending + 1] = enqueue()
          free("grad", fb)
        end
        reshard(k)
        if cfg.prefetch == "backward_post" then
          local j = last_index(order, #order, k)
          if j and j > 1 then prefetch(order[j - 1]) end
        end
      end
    end
    -- finish: wait for every reduction in issue order, then drop the outputs
    if #pending > 0 then complete_upto(pending[#pending]) end
    for _, u in ipairs(us) do free("comm", u.reduced_bytes) end
  end
  -- the comm thread's scratch (bf16 reductions), on top of every output
  local outputs, scratch = 0, 0
  for _, u in ipairs(us) do
    outputs = outputs + u.reduced_bytes
    scratch = math.max(scratch, u.scratch_bytes)
  end
  peak.comm = math.max(peak.comm, outputs + scratch)
  return peak, t, peak_gathered
end

--- plan(model, opts, world) -> a table (see the top of this file and M.format).
function M.plan(model, opts, world)
  opts = opts or {}
  if type(model) ~= "table" or not model._param_names then fail("expected an nn module") end
  if world == nil then world = opts.world or require("fsdp").world() end
  local cfg = check_options(opts, world)
  local G, cb, rb = cfg.group_size, dtype_bytes[cfg.compute], dtype_bytes[cfg.reduce]
  local round = M.round
  local raw = require("fsdp.shard").assign_units(model, opts.policy)
  local events, order, parent, depth = execution_tree(model, raw)

  local units, total_numel, total_tensors = {}, 0, 0
  for k, u in ipairs(raw) do
    local padded = math.max(math.ceil(u.numel / G) * G, G)
    local shard_n = padded / G
    local params = {}
    for i, p in ipairs(u.params) do
      params[i] = { path = p.path, shape = p.shape, numel = p.numel }
    end
    units[k] = {
      index = k, path = u.path, name = u.path == "" and "root" or u.path, tensors = #u.params, numel = u.numel,
      bytes_f32 = 4 * u.numel, padded = padded, shard_numel = shard_n, params = params,
      keep = k == 1 or cfg.strategy == "shard_grad_op", parent = parent[k], depth = depth[k],
      master_bytes = round(4 * shard_n), grad_bytes = round(4 * shard_n),
      full_bytes = round(padded * cb), flat_bytes = round(padded * cb),
      reduced_bytes = round(shard_n * rb),
      scratch_bytes = rb == 2 and (round(padded * 4) + round(shard_n * 4)) or 0,
    }
    total_numel = total_numel + u.numel
    total_tensors = total_tensors + #u.params
  end

  -- a unit whose module has no forward of its own (a ModuleList) is never
  -- called, so fsdp.shard would never gather it
  local warnings = {}
  local base_forward = require("fsdp.nn.module").forward
  for k = 2, #raw do
    local m = raw[k].module
    if m.forward == base_forward then
      warnings[#warnings + 1] = string.format("unit '%s' (%s) has no forward of its own: nothing calls it, so its "
        .. "%d parameters would never be gathered and the model's forward would fail; wrap its children instead",
        raw[k].path, m.__name, raw[k].numel)
    end
  end

  local peak, traffic, peak_gathered = simulate(cfg, units, events, true)
  local eager = simulate(cfg, units, events, false)

  -- persistent per rank; only the optimizer state depends on the shard index
  local master, gshard = 0, 0
  for _, u in ipairs(units) do
    master = master + u.master_bytes
    gshard = gshard + u.grad_bytes
  end
  local ranks = {}
  for s = 0, G - 1 do
    local opt_bytes, owned = 0, 0
    for _, u in ipairs(units) do
      local lo, hi, off = s * u.shard_numel, (s + 1) * u.shard_numel, 0
      for _, p in ipairs(u.params) do
        local len = math.min(hi, off + p.numel) - math.max(lo, off)
        if len > 0 then
          owned = owned + len
          opt_bytes = opt_bytes + cfg.optimizer_states * round(4 * len)
        end
        off = off + p.numel
      end
    end
    local host = { param = master, grad = gshard, optimizer = opt_bytes, total = master + gshard + opt_bytes }
    if cfg.offload then   -- the device keeps none of them
      master, gshard, opt_bytes = 0, 0, 0
    else
      host = nil
    end
    local r = {
      shard_index = s, owned_numel = owned,
      param = { persistent = master, peak = peak.param },
      grad = { persistent = gshard, peak = peak.grad, peak_if_comm_keeps_up = eager.grad },
      optimizer = { persistent = opt_bytes, peak = opt_bytes },
      comm = { persistent = 0, peak = peak.comm },
      host = host,
    }
    r.persistent = master + gshard + opt_bytes
    r.peak = peak.param + peak.grad + opt_bytes    -- param + grad + optimizer, each at its peak
    if host then master, gshard = host.param, host.grad end
    ranks[s + 1] = r
  end
  local max = { param = {}, grad = { peak_if_comm_keeps_up = eager.grad }, optimizer = {}, comm = {}, persistent = 0,
    peak = 0 }
  for _, r in ipairs(ranks) do
    for _, tag in ipairs({ "param", "grad", "optimizer", "comm" }) do
      max[tag].persistent = math.max(max[tag].persistent or 0, r[tag].persistent)
      max[tag].peak = math.max(max[tag].peak or 0, r[tag].peak)
    end
    max.persistent = math.max(max.persistent, r.persistent)
    max.peak = math.max(max.peak, r.peak)
    if r.host then max.host = math.max(max.host or 0, r.host.total) end
  end

  -- the same model without FSDP: every tensor whole, its gradient, its state
  local un = { param = 0, grad = 0, optimizer = 0 }
  for _, u in ipairs(units) do
    for _, p in ipairs(u.params) do
      local b = round(4 * p.numel)
      un.param = un.param + b
      un.grad = un.grad + b
      un.optimizer = un.optimizer + cfg.optimizer_states * b
    end
  end
  un.total = un.param + un.grad + un.optimizer

  local n_units = #units
  local rs_bytes, ar_bytes, ar_count = 0, 0, 0
  for _, u in ipairs(units) do
    rs_bytes = rs_bytes + u.padded * rb
    if cfg.replicas > 1 then
      ar_bytes = ar_bytes + u.shard_numel * rb
      ar_count = ar_count + 1
    end
  end
  local tr = {
    gathers_forward = traffic.gathers.forward, gathers_backward = traffic.gathers.backward,
    gather_bytes = traffic.gather_bytes,
    gather_network_bytes = G > 1 and traffic.gather_bytes or 0,
    reduce_scatters = n_units, reduce_scatter_bytes = rs_bytes,
    reduce_scatter_network_bytes = G > 1 and rs_bytes or 0,
    all_reduces = ar_count, all_reduce_bytes = ar_bytes,
  }
  tr.reduced_bytes = rs_bytes + ar_bytes
  tr.network_bytes = tr.gather_network_bytes + tr.reduce_scatter_network_bytes + ar_bytes

  return {
    world = cfg.world, strategy = cfg.strategy, group_size = G, replicas = cfg.replicas, compute = cfg.compute,
    reduce = cfg.reduce, prefetch = cfg.prefetch, forward_prefetch = cfg.forward_prefetch, limit = cfg.limit,
    optimizer_states = cfg.optimizer_states, offload = cfg.offload,
    units = units, order = order, numel = total_numel, tensors = total_tensors,
    ranks = ranks, rank0 = ranks[1], max = max, unsharded = un, traffic = tr, peak_gathered = peak_gathered,
    warnings = warnings,
  }
end

--- The prediction for global rank r (its index in its shard group).
function M.for_rank(p, r)
  return p.ranks[(r % p.group_size) + 1]
end

-- ---- formatting ----

local function mib(b) return string.format("%.2f", b / 2 ^ 20) end

local function commas(n)
  local s = tostring(math.floor(n))
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^,", ""))
end

--- A readable multi-line description of a plan.
function M.format(p)
  local L = {}
  local function add(...) L[#L + 1] = string.format(...) end
  local groups = p.strategy == "no_shard" and "replicated, no sharding"
      or string.format("shard group of %d rank%s", p.group_size, p.group_size == 1 and "" or "s")
  add("FSDP plan: %d rank%s, %s (%s, %d replica%s), compute %s, reduce %s", p.world, p.world == 1 and "" or "s",
    p.strategy, groups, p.replicas, p.replicas == 1 and "" or "s", p.compute, p.reduce)
  add("  prefetch %s%s, limit %d gathered units; optimizer state %d x f32 per element%s", p.prefetch,
    p.forward_prefetch and " + forward" or "", p.limit, p.optimizer_states,
    p.offload and "; shards and optimizer state offloaded to the CPU" or "")
  add("model: %s parameters (%.2f MiB f32) in %d tensors, %d unit%s", commas(p.numel), p.numel * 4 / 2 ^ 20,
    p.tensors, #p.units, #p.units == 1 and "" or "s")
  add("")
  add("units, in execution order (* = stays gathered from forward to backward)")
  add("  %-3s %-26s %7s %14s %10s %14s %12s", "#", "unit", "tensors", "params", "MiB f32", "padded", "shard/rank")
  for pos, k in ipairs(p.order) do
    local u = p.units[k]
    local name = string.rep("  ", u.depth) .. u.name .. (u.keep and "*" or "")
    add("  %-3d %-26s %7d %14s %10s %14s %12s", pos, name, u.tensors, commas(u.numel), mib(u.bytes_f32),
      commas(u.padded), commas(u.shard_numel))
  end
  add("")
  local r0, mx = p.rank0, p.max
  add("memory per rank, MiB (allocator rounding applied)          %10s %10s", "rank 0", "max")
  local function row(label, a, b) add("  %-55s %10s %10s", label, mib(a), mib(b)) end
  row("param      master shards (persistent)", r0.param.persistent, mx.param.persistent)
  row(string.format("           peak, with gathered full buffers (%s)", p.compute), r0.param.peak, mx.param.peak)
  row("grad       gradient shards (persistent)", r0.grad.persistent, mx.grad.persistent)
  row(string.format("           peak, with flat gradients (%s)", p.compute), r0.grad.peak, mx.grad.peak)
  if mx.grad.peak_if_comm_keeps_up < mx.grad.peak then
    row("           (peak if every reduce-scatter ends at once)", r0.grad.peak_if_comm_keeps_up,
      mx.grad.peak_if_comm_keeps_up)
  end
  row("optimizer  state of this rank's parameter slices", r0.optimizer.peak, mx.optimizer.peak)
  row(string.format("comm       peak, reduce-scatter outputs (%s)", p.reduce), r0.comm.peak, mx.comm.peak)
  row("param + grad + optimizer, persistent", r0.persistent, mx.persistent)
  row("param + grad + optimizer, peak", r0.peak, mx.peak)
  if p.offload then
    row("host: shards + optimizer state (offload)", r0.host.total, mx.host)
  end
  local un = p.unsharded
  add("  %-55s %10s   (param %s + grad %s + optimizer %s)", "unsharded model (no FSDP, one process)", mib(un.total),
    mib(un.param), mib(un.grad), mib(un.optimizer))
  add("  per-rank peak / unsharded: %.3f (1/%d = %.3f); at most %d unit%s gathered at once", mx.peak / un.total,
    p.group_size, 1 / p.group_size, p.peak_gathered, p.peak_gathered == 1 and "" or "s")
  add("")
  local t = p.traffic
  add("traffic per training step per rank, MiB (as fsdp_comm_stats counts; network excludes one-rank groups)")
  add("  %-55s %10s %10s", "", "counted", "network")
  add("  %-55s %10s %10s", string.format("all-gather     %d forward + %d backward gathers (%s)", t.gathers_forward,
    t.gathers_backward, p.compute), mib(t.gather_bytes), mib(t.gather_network_bytes))
  add("  %-55s %10s %10s", string.format("reduce-scatter %d x padded unit (%s)", t.reduce_scatters, p.reduce),
    mib(t.reduce_scatter_bytes), mib(t.reduce_scatter_network_bytes))
  add("  %-55s %10s %10s", string.format("all-reduce     %d x shard across %d replicas (%s)", t.all_reduces,
    p.replicas, p.reduce), mib(t.all_reduce_bytes), mib(t.all_reduce_bytes))
  add("  %-55s %10s %10s", "total (gathered + reduced)", mib(t.gather_bytes + t.reduced_bytes), mib(t.network_bytes))
  for _, w in ipairs(p.warnings) do add("warning: %s", w) end
  return table.concat(L, "\n")
end

return M
