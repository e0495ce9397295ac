-- fsdp.checkpoint.dirs: the checkpoints of one folder (root/step_NNNNNNNN)
-- as a run sees them: which of them verify, which line of runs each
-- belongs to, repairing a publish a kill interrupted, moving another line's
-- checkpoints aside, and retention. Rank 0 does all of it; callers agree.
--
-- A line: the run that saves ({ id = ..., forked = { {id =, step =}, ...} }):
-- its own checkpoints, and those of each run it went on from up to the
-- step it went on from. A checkpoint's index stores its line ("run").
local fio = require "fsdp.io"
local json = require "fsdp.json"
local format = require "fsdp.checkpoint.format"

local fmt, sort = string.format, table.sort

local M = {}

-- Where checkpoints of another line go when a run saves into their folder.
M.ASIDE = "abandoned"

local function remove_tree(path)
  if path == "" or path == "/" then error("refusing to remove '" .. path .. "'", 0) end
  fio.remove_tree(path)
end

function M.step_dir(root, step) return fmt("%s/step_%08d", root, step) end

local function names(root)
  if not fio.is_dir(root) then return {} end
  return fio.list_dir(root)
end

--- dirs.list(root) -> { {step, dir} } of every step_N folder, oldest first.
function M.list(root)
  local l = {}
  for _, name in ipairs(names(root)) do
    local n = name:match("^step_(%d+)$")
    if n and fio.is_dir(root .. "/" .. name) then l[#l + 1] = { step = tonumber(n), dir = root .. "/" .. name } end
  end
  sort(l, function(a, b) return a.step < b.step end)
  return l
end

--- dirs.verify(dir) -> index, or nil and why not: the index (its checksum,
-- its structure) and every file it names, there with its size. The data's
-- checksums are checked by a load, which reads it.
function M.verify(dir)
  local ipath = format.index_path(dir)
  local kind = fio.stat(ipath)
  if kind ~= "file" then return nil, "no index.json (a save that did not finish)" end
  local ok, index = pcall(format.read_index, dir)
  if not ok then return nil, (tostring(index):gsub("^" .. ipath:gsub("%p", "%%%0") .. ": ", "index.json: ")) end
  if type(index.num_files) == "number" and index.num_files ~= #index.files then
    return nil, fmt("index.json lists %d file(s) of %d", #index.files, index.num_files)
  end
  for _, fe in ipairs(index.files) do
    local k, bytes = fio.stat(dir .. "/" .. fe.name)
    if k ~= "file" then return nil, fmt("%s is missing (shard rank %d's file)", fe.name, tonumber(fe.name:match("%d+"))) end
    if bytes ~= fe.bytes then
      return nil, fmt("%s has %d bytes, index.json says %d (truncated or replaced)", fe.name, bytes, fe.bytes)
    end
  end
  return index
end

--- dirs.newest(root) -> dir, step, index of the newest checkpoint that
-- verifies (nil when none), and the newer ones that do not: { {dir, reason} }.
function M.newest(root)
  local l, skipped = M.list(root), {}
  for i = #l, 1, -1 do
    local index, why = M.verify(l[i].dir)
    if index then return l[i].dir, l[i].step, index, skipped end
    skipped[#skipped + 1] = { dir = l[i].dir, reason = why }
  end
  return nil, nil, nil, skipped
end

--- dirs.recover(root, log): a save killed while it published leaves
-- step_N.tmp (complete once its index is there: the index is written after
-- every file was confirmed) and step_N.old (the copy it replaced). When
-- step_N is missing, the complete one of them becomes step_N again; debris
-- (an unfinished .tmp, an .old whose step_N verifies) is removed.
function M.recover(root, log)
  local list = names(root)
  local present = {}
  for _, name in ipairs(list) do present[name] = true end
  local function pass(suffix)
    for _, name in ipairs(list) do
      local base = name:match("^(step_%d+)%." .. suffix .. "$")
      if base and present[name] then
        local path, target = root .. "/" .. name, root .. "/" .. base
        if present[base] and M.verify(target) then
          remove_tree(path)
        elseif not present[base] and M.verify(path) then
          fio.rename(path, target)
          present[base] = true
          if log then
            log("%s: %s was published only in part (a kill between its renames); %s is it again", root,
              base, name)
          end
        elseif suffix == "tmp" and not M.verify(path) then
          remove_tree(path)   -- an unfinished save
        end
        present[name] = nil
      end
    end
  end
  pass("tmp")   -- newer than .old: a save over step_N had finished writing it
  pass("old")
end

--- The line a checkpoint's index names (checkpoints written before lines
-- existed belong to the run with id "").
function M.line_of(index)
  local r = type(index) == "table" and index.run
  if type(r) ~= "table" or type(r.id) ~= "string" then return { id = "", forked = {} } end
  return { id = r.id, forked = type(r.forked) == "table" and r.forked or {} }
end

--- The line of a run that goes on from checkpoint `index` under a new id.
function M.child_line(index, id)
  local parent = M.line_of(index)
  local forked = {}
  for i, f in ipairs(parent.forked) do forked[i] = { id = f.id, step = f.step } end
  forked[#forked + 1] = { id = parent.id, step = index.step }
  return { id = id, forked = json.array(forked) }
end

--- Whether a checkpoint (its index) is on the line.
function M.on_line(index, line)
  local mine = M.line_of(index)
  if mine.id == line.id then return true end
  for _, f in ipairs(line.forked) do
    if f.id == mine.id and type(index.step) == "number" and index.step <= f.step then return true end
  end
  return false
end

--- dirs.move_aside(root, line, log) -> how many: the checkpoints in root of
-- another line (another run, or the future a rolled-back run abandoned)
-- move to root/abandoned/<line id>/, so that the line's own saves, its
-- retention and a later plain resume see only the line.
function M.move_aside(root, line, log)
  local moved = {}
  for _, e in ipairs(M.list(root)) do
    local index = M.verify(e.dir)
    if index and not M.on_line(index, line) then moved[#moved + 1] = { e = e, run = M.line_of(index).id } end
  end
  if #moved == 0 then return 0 end
  local into = fmt("%s/%s/%s", root, M.ASIDE, line.id)
  fio.mkdirs(into)
  local steps = {}
  for _, m in ipairs(moved) do
    local name = m.e.dir:match("[^/]+$")
    remove_tree(into .. "/" .. name)
    fio.rename(m.e.dir, into .. "/" .. name)
    steps[#steps + 1] = tostring(m.e.step)
  end
  if log then
    log("%s: moved %d checkpoint(s) of another run or an abandoned future (step%s %s) to %s; this run's line goes "
      .. "on in %s", root, #moved, #steps > 1 and "s" or "", table.concat(steps, ", "), into, root)
  end
  return #moved
end

--- dirs.retain(root, keep, line): keeps the newest `keep` checkpoints that
-- verify (of the line, when given); one that does not verify never counts
-- and is left for a person to look at, so retention cannot remove the
-- last good checkpoint in favour of a damaged one.
function M.retain(root, keep, line)
  local good = {}
  for _, e in ipairs(M.list(root)) do
    local index = M.verify(e.dir)
    if index and (not line or M.on_line(index, line)) then good[#good + 1] = e end
  end
  for i = 1, #good - keep do remove_tree(good[i].dir) end
end

return M
