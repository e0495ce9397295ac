-- fsdp.plan_cli: what `fsdp-lua --plan` does after the plan itself: the
-- predicted step (fsdp.plan_time), the --memory verdict and the settings
-- that would make a run fit, --tune's search, --all-ranks' comparison of
-- every rank, and --plan-json.
--
--   fsdp-lua --plan --world=64 --ranks-per-node=8 --link=100Gbit,20us recipes/gpt2.lua --preset=small
--   fsdp-lua --plan --world=8 --memory=2GiB recipes/gpt2.lua --preset=small --batch=64 --ctx=1024
--   fsdp-lua --plan --world=64 --tune --memory=8GiB recipes/gpt2.lua --preset=small
--   fsdp-lua --plan --world=8 --all-ranks recipes/my_recipe.lua
local planner = require "fsdp.plan"
local pt = require "fsdp.plan_time"
local options = require "fsdp.options"

local M = {}

--- Checks the planner's options (strings as given) against the world;
-- returns the parsed table, or nil and one line saying what is wrong.
function M.check(o, world)
  local r = { tune = o.tune, all_ranks = o.all_ranks, plan_json = o.plan_json }
  if o.link then
    local l, why = pt.parse_link(o.link)
    if not l then return nil, "--link: " .. why end
    r.link = l
  end
  if o.ranks_per_node then
    local k = tonumber(o.ranks_per_node)
    if not k or k < 1 or k ~= math.floor(k) then
      return nil, "--ranks-per-node expects a positive whole number, as --ranks-per-node=8 (got '"
        .. tostring(o.ranks_per_node) .. "')"
    end
    if world % k ~= 0 then
      return nil, string.format("--ranks-per-node=%d does not divide --world=%d", k, world)
    end
    r.ranks_per_node = k
  end
  if o.memory then
    local b, why = pt.parse_size(o.memory)
    if not b then return nil, "--memory: " .. why end
    r.memory = b
  end
  if r.link and not r.ranks_per_node then
    return nil, "--link describes the link between nodes: give --ranks-per-node=K too"
  end
  return r
end

local function gib(b)
  if math.abs(b) < 2 ^ 30 then return string.format("%.2f MiB", b / 2 ^ 20) end
  return string.format("%.2f GiB", b / 2 ^ 30)
end
local function signed_gib(b) return (b >= 0 and "+" or "-") .. gib(math.abs(b)) end

-- The recipe's options as a command line ("--key=value", dashes restored).
local function args_line(args)
  local keys = {}
  for k in pairs(args) do if type(k) == "string" then keys[#keys + 1] = k end end
  table.sort(keys)
  local parts = {}
  for _, v in ipairs(args) do parts[#parts + 1] = tostring(v) end
  for _, k in ipairs(keys) do
    local v, name = args[k], k:gsub("_", "-")
    if v == true then parts[#parts + 1] = "--" .. name
    elseif v == false then parts[#parts + 1] = "--no-" .. name
    else parts[#parts + 1] = "--" .. name .. "=" .. tostring(v) end
  end
  return table.concat(parts, " ")
end

local function copy(t, changes)
  local c = {}
  for k, v in pairs(t) do c[k] = v end
  for k, v in pairs(changes or {}) do
    if v == "nil" then c[k] = nil else c[k] = v end
  end
  return c
end

-- One configuration planned (rank 0, memory of that rank, no progress
-- bar): { peak, step (seconds), traffic bytes, plan } or nil and why (a
-- usage error of the recipe: an option it does not take or refuses).
local function try(chunk, o, args)
  local p
  local ok, err = pcall(function()
    p = planner.run(chunk, { world = o.world, rank = 0, mimic = o.device, progress = false }, args)
  end)
  if not ok then
    if options.is_usage_error(err) then return nil, err.message end
    return nil, tostring(err)
  end
  local r = pt.predict(p, o)
  return { peak = p.memory.total.peak, step = r and r.step, traffic = p.traffic.gathered_bytes + p.traffic.reduced_bytes,
    plan = p, prediction = r }
end

-- What could lower the peak, as changes to the recipe's options.
local function fit_candidates(args, world, K)
  local c = {}
  local function add(ch) c[#c + 1] = ch end
  if not args.recompute then add({ recompute = true }) end
  if (args.head_chunk or 0) == 0 then add({ head_chunk = 8192 }) end
  if (args.limit or 2) > 1 then add({ limit = 1 }) end
  if args.strategy and args.strategy ~= "full_shard" then add({ strategy = "full_shard", group_size = "nil" }) end
  if (args.dtype or "f32") ~= "bf16" then add({ dtype = "bf16" }) end
  if args.forward_prefetch ~= false then add({ forward_prefetch = false }) end   -- on by default
  if (args.accum or 1) == 1 and (args.batch or 8) % (2 * world) == 0 then add({ accum = 2 }) end
  add({ recompute = true, head_chunk = 8192, limit = 1 })
  return c
end

local function describe(ch)
  local parts = {}
  for k, v in pairs(ch) do
    local name = k:gsub("_", "-")
    if v == "nil" then
    elseif v == true then parts[#parts + 1] = "--" .. name
    elseif v == false then parts[#parts + 1] = "--no-" .. name
    else parts[#parts + 1] = "--" .. name .. "=" .. tostring(v) end
  end
  table.sort(parts)
  return table.concat(parts, " ")
end

local function step_ms(s) return s and string.format("%.2f ms", s * 1e3) or "? ms" end

--- The --memory verdict and, when over, what would fit. Returns lines.
function M.verdict(chunk, o, args, p, r)
  local L = {}
  local peak = p.memory.total.peak
  if peak <= o.memory then
    L[#L + 1] = string.format("fits: yes (peak %s of %s)", gib(peak), gib(o.memory))
    return L, true
  end
  L[#L + 1] = string.format("fits: no (peak %s, over by %s)", gib(peak), gib(peak - o.memory))
  local found = 0
  for _, ch in ipairs(fit_candidates(args, o.world, o.ranks_per_node or o.world)) do
    local q = try(chunk, o, copy(args, ch))
    if q then
      local dstep = (q.step and r) and string.format("step %+.0f%%", 100 * (q.step / r.step - 1)) or "step ?"
      if q.peak <= o.memory then
        found = found + 1
        L[#L + 1] = string.format("  %s: peak %s (%s), %s (%s)", describe(ch), signed_gib(q.peak - peak), gib(q.peak),
          dstep, step_ms(q.step))
      end
    end
  end
  if found == 0 then
    L[#L + 1] = "  none of --recompute, --head-chunk, --limit=1, --dtype=bf16, --accum=2 fits, alone or together"
  end
  return L, false
end

-- The settings --tune searches, as the recipe's options, each a list of values.
local function tune_space(args, world, K)
  local groups = {}
  if K < world then groups = { K } end
  local space = {
    { "strategy", { "full_shard", "shard_grad_op", "no_shard", "hybrid_shard" } },
    { "prefetch", { "backward_pre", "backward_post", "none" } },
    { "forward_prefetch", { false, true } },
    { "limit", { 1, 2, 4 } },
    { "recompute", { false, true } },
    { "head_chunk", { 0, 8192 } },
    { "reshard_group", { 0, K < world and K or nil } },
    { "reduce", { "f32", "bf16" } },
  }
  return space, groups
end

local function config_key(args)
  return args_line(args)
end

--- --tune: a coordinate search from the given options (each setting in
-- turn over its values, the others kept at the best so far, twice over),
-- every configuration planned on the counting device. Returns lines and the
-- best configuration's options (nil when none fits).
function M.tune(chunk, o, args, script)
  local K = o.ranks_per_node or o.world
  local space, groups = tune_space(args, o.world, K)
  local seen, tried = {}, {}
  local no_price   -- why a configuration could not be priced
  local function eval(cand)
    if cand.strategy == "hybrid_shard" then
      if #groups == 0 then return nil end
      cand.group_size = groups[1]
    else
      cand.group_size = nil
    end
    if (cand.reshard_group or 0) > 0 and cand.strategy ~= "full_shard" and cand.strategy ~= "hybrid_shard" then
      return nil
    end
    local key = config_key(cand)
    if seen[key] ~= nil then return seen[key] or nil end
    local q, why = try(chunk, o, cand)
    if q and not q.step then
      local _, w = pt.predict(q.plan, o)
      no_price = w
    end
    if q and q.step then
      q.args = cand
      q.fits = not o.memory or q.peak <= o.memory
      tried[#tried + 1] = q
      seen[key] = q
    else
      seen[key] = false
    end
    return q
  end
  local function better(a, b)
    if not b then return true end
    if a.fits ~= b.fits then return a.fits end
    if a.fits then return a.step < b.step end
    return a.peak < b.peak
  end
  local best = eval(copy(args))
  for _ = 1, 2 do
    for _, dim in ipairs(space) do
      for _, v in ipairs(dim[2]) do
        local cand = copy(best and best.args or args)
        cand[dim[1]] = v
        local q = eval(cand)
        if q and better(q, best) then best = q end
      end
    end
  end
  local fits = {}
  for _, q in ipairs(tried) do if q.fits then fits[#fits + 1] = q end end
  local L = {}
  if #tried == 0 then
    return { "tune: no configuration could be priced (" .. tostring(no_price or "the recipe refused them all") .. ")" }, nil
  end
  if #fits == 0 then
    table.sort(tried, function(a, b) return a.peak < b.peak end)
    L[#L + 1] = string.format("tune: nothing of the %d configurations tried fits --memory=%s; the closest:", #tried,
      gib(o.memory))
    for i = 1, math.min(3, #tried) do
      local q = tried[i]
      L[#L + 1] = string.format("  peak %s, over by %s: %s", gib(q.peak), gib(q.peak - o.memory), args_line(q.args))
    end
    return L, nil
  end
  -- the same figures from different spellings (a value the recipe takes by
  -- default given or not): the shortest command line stands for them
  table.sort(fits, function(a, b)
    if a.step ~= b.step then return a.step < b.step end
    return #args_line(a.args) < #args_line(b.args)
  end)
  local distinct, last = {}, nil
  for _, q in ipairs(fits) do
    local sig = string.format("%.6e %d %d", q.step, q.peak, q.traffic)
    if sig ~= last then distinct[#distinct + 1] = q end
    last = sig
  end
  fits = distinct
  L[#L + 1] = string.format("tune: %d configurations planned, %d fit%s; the fastest:", #tried, #fits,
    o.memory and (" --memory=" .. gib(o.memory)) or "")
  L[#L + 1] = "     step       peak     traffic   options"
  for i = 1, math.min(5, #fits) do
    local q = fits[i]
    L[#L + 1] = string.format("  %9s %10s %9.1f MiB   %s", step_ms(q.step), gib(q.peak), q.traffic / 2 ^ 20,
      args_line(q.args))
  end
  L[#L + 1] = string.format("best: mpirun -np %d fsdp-lua %s %s", o.world, script, args_line(fits[1].args))
  return L, fits[1]
end

-- ---- every rank ----

-- Each rank's collectives per communicator, { [comm] = { fingerprints } },
-- and its peak, from a dry run of that rank.
local function rank_record(chunk, o, args, rank)
  local p = planner.run(chunk, { world = o.world, rank = rank, mimic = o.device, progress = false }, args)
  local per = {}
  for _, ev in ipairs(p.timeline) do
    if ev.type == "issue" then
      local list = per[ev.comm] or {}
      per[ev.comm] = list
      list[#list + 1] = ev
    end
  end
  return { per = per, peak = p.memory.total.peak }
end

local dtype_names = { [0] = "f32", "bf16", "i32", "i64", "u8", "f16", [100] = "f64", [-1] = "" }
local function fp_text(ev)
  if not ev then return "nothing (its collectives ended before)" end
  return string.format("#%d %s %d B %s", ev.seq, ev.kind:gsub("_", "-"), ev.bytes, dtype_names[ev.dtype] or ev.dtype)
end
local function same(a, b)
  return a and b and a.kind == b.kind and a.bytes == b.bytes and a.dtype == b.dtype and a.label == b.label
end

--- --all-ranks: every rank's counted step against rank 0's (and, per
-- communicator, against the first rank in it). Returns lines and whether
-- all agree.
function M.all_ranks(chunk, o, args)
  local L, ok = {}, true
  local first = {}    -- per communicator: { rank, list } of the first rank seen in it
  local peaks = {}
  local diverged = 0
  for r = 0, o.world - 1 do
    local rec = rank_record(chunk, o, args, r)
    peaks[r] = rec.peak
    for comm, list in pairs(rec.per) do
      local f = first[comm]
      if not f then
        first[comm] = { rank = r, list = list }
      elseif diverged < 5 then
        for i = 1, math.max(#list, #f.list) do
          if not same(list[i], f.list[i]) then
            ok, diverged = false, diverged + 1
            L[#L + 1] = string.format("all ranks: collective %d of a communicator of %d ranks differs: rank %d issues "
              .. "%s, rank %d issues %s", i, (list[1] or f.list[1]).size, f.rank, fp_text(f.list[i]), r, fp_text(list[i]))
            break
          end
        end
      end
    end
    collectgarbage()
  end
  local over = {}
  for r = 1, o.world - 1 do
    if peaks[r] > 1.05 * peaks[0] then over[#over + 1] = string.format("rank %d (%s, %+.1f%%)", r, gib(peaks[r]),
      100 * (peaks[r] / peaks[0] - 1)) end
  end
  if #over > 0 then
    ok = false
    L[#L + 1] = string.format("all ranks: peak more than 5%% above rank 0's %s: %s", gib(peaks[0]),
      table.concat(over, ", ", 1, math.min(#over, 8)) .. (#over > 8 and ", ..." or ""))
  end
  if ok then
    L[#L + 1] = string.format("all ranks: the %d ranks issue the same collectives on every communicator, peaks within "
      .. "5%% of rank 0's", o.world)
  end
  return L, ok
end

--- After the plan's own report: the prediction, the verdict, --tune,
-- --all-ranks, --plan-json. Returns the exit status.
function M.report(chunk, args, o, p, script)
  local out = {}
  local function say(lines)
    if type(lines) == "string" then lines = { lines } end
    for _, l in ipairs(lines) do io.stdout:write(l, "\n") end
  end
  say("")
  local r, why = pt.predict(p, o)
  if r then
    say(pt.format(r))
    out.predicted = { step_ms = r.step * 1e3, compute_ms = r.compute * 1e3, communication_ms = r.communication * 1e3,
      exposed_ms = r.exposed * 1e3, collectives = r.collectives, assumptions = r.assumptions }
  else
    say("predicted step: none (" .. why .. ")")
  end
  out.peak_bytes = p.memory.total.peak
  out.traffic = { gathered_bytes = p.traffic.gathered_bytes, reduced_bytes = p.traffic.reduced_bytes }
  local code = 0
  if o.memory and not o.tune then
    local lines, fits = M.verdict(chunk, o, args, p, r)
    say(lines)
    out.fits, out.memory_bytes = fits, o.memory
  end
  if o.tune then
    local lines, best = M.tune(chunk, o, args, script)
    say(lines)
    if best then
      out.best = { args = args_line(best.args), step_ms = best.step * 1e3, peak_bytes = best.peak }
      out.best_command = lines[#lines]:gsub("^best: ", "")
    else
      code = 3
    end
  end
  if o.all_ranks then
    local lines, agree = M.all_ranks(chunk, o, args)
    say(lines)
    out.all_ranks_agree = agree
    if not agree then code = 4 end
  end
  if o.plan_json then
    local ok, err = pcall(require("fsdp.io").write_atomic, o.plan_json, require("fsdp.json").encode(out) .. "\n")
    if not ok then
      io.stderr:write("fsdp-lua: --plan-json: cannot write '", o.plan_json, "': ", tostring(err), "\n")
      return 1
    end
  end
  return code
end

return M
