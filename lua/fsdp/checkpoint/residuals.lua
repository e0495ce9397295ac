-- fsdp.checkpoint.residuals: the error-feedback residuals of compressed
-- gradient reduction (fsdp.compress) in a checkpoint. Each is one rank's
-- (what it did not send of its own gradient, the whole padded unit), so
-- every rank writes its own file residual_rank_NNNNN.bin (world rank), one
-- blob per unit that has one, hashed as the shard files are; index.json's
-- "compress" entry records the settings, the world size and each file's
-- blobs. A load on the same world size and units restores them bit for
-- bit; otherwise (another rank count or wrap, a run without compression,
-- a checkpoint without residuals) the residuals start from zero and the
-- load says so (info.residuals).
local ffi = require "ffi"
local fio = require "fsdp.io"
local json = require "fsdp.json"
local compress = require "fsdp.compress"
local format = require "fsdp.checkpoint.format"

local fmt = string.format

local M = {}

local function file_name(rank) return fmt("residual_rank_%05d.bin", rank) end

-- The units of sharded that compress, with their residual (or nil).
local function units_of(sharded)
  local list = {}
  for _, u in ipairs(sharded.units) do
    if not u.frozen then list[#list + 1] = { u = u, residual = compress.residual(sharded, u.index) } end
  end
  return list
end

--- Writes this rank's residuals into tmp; returns its record (nil: none).
-- out: write.lua's blob writer { new, put, finish }.
function M.write(d, tmp, out)
  local sh = d.sharded
  if not sh or not compress.describe(sh) then return nil end
  local o = out.new(tmp .. "/" .. file_name(d.rank))
  local rec = { file = file_name(d.rank), rank = d.rank, units = {} }
  local ok, err = pcall(function()
    for _, e in ipairs(units_of(sh)) do
      if e.residual then
        local n = e.residual:numel()
        local off, sum = out.put(o, e.residual:read_ptr(), 4 * n)
        rec.units[#rec.units + 1] = { name = e.u.name, count = n, offset = off, checksum = sum }
      end
    end
    rec.checksum = out.finish(o)
    rec.bytes = o.pos
  end)
  if not ok then
    if o.f then o.f:close() end
    error(err, 0)
  end
  return rec
end

--- index.json's entry from every rank's record (texts: JSON by rank).
function M.index_entry(d, texts)
  local c = d.sharded and compress.describe(d.sharded)
  if not c then return nil end
  local e = { grads = c.grads, block = c.block, density = c.density, error_feedback = c.error_feedback,
    world_size = d.world, files = json.array({}) }
  for _, text in ipairs(texts) do
    local r = json.decode(text)
    if type(r) == "table" and r.file then e.files[#e.files + 1] = r end
  end
  return e
end

local function zero_all(sh)
  for _, e in ipairs(units_of(sh)) do
    if e.residual then compress.set_residual(sh, e.u.index, nil) end
  end
end

-- Reads this rank's blobs of entry (its file record) and checks them.
local function read_mine(dir, rec, by_name)
  local path = dir .. "/" .. rec.file
  local okf, f = pcall(fio.open, path, "r")
  if not okf then error(fmt("fsdp.checkpoint.load: %s: cannot open: %s", path, tostring(f)), 0) end
  local vals = {}
  local ok, err = pcall(function()
    if f:size() ~= rec.bytes then
      error(fmt("fsdp.checkpoint.load: %s: %d bytes, index.json says %d", path, f:size(), rec.bytes), 0)
    end
    local h = fio.hasher()
    for _, b in ipairs(rec.units) do
      local u = by_name[b.name]
      local nbytes = format.padded(4 * b.count)
      local buf = ffi.new("uint8_t[?]", nbytes)
      if f:pread(buf, nbytes, b.offset) ~= nbytes then
        error(fmt("fsdp.checkpoint.load: %s: short read in the residual of unit %s", path, b.name), 0)
      end
      h:reset()
      h:update(buf, nbytes)
      if h:hex() ~= b.checksum then
        error(fmt("fsdp.checkpoint.load: %s: checksum mismatch in the residual of unit %s: the file is corrupted",
          path, b.name), 0)
      end
      local t = require("fsdp").empty({ b.count }, { dtype = "f32", device = "cpu" })
      ffi.copy(t:data_ptr(), buf, 4 * b.count)
      vals[#vals + 1] = { u = u, t = t }
    end
  end)
  f:close()
  if not ok then error(err, 0) end
  return vals
end

--- After a load's commit: restores or resets the residuals of d.sharded.
-- together: common.together. Returns what happened to them (a sentence),
-- or nil when neither side compresses.
function M.restore(dir, index, d, together)
  local sh = d.sharded
  local mine = sh and compress.describe(sh)
  local saved = type(index.compress) == "table" and index.compress or nil
  if not mine then
    return saved and fmt("the checkpoint's %s compression residuals are not used: this run does not compress "
      .. "gradients", tostring(saved.grads)) or nil
  end
  if not saved then
    zero_all(sh)
    return "compression residuals start from zero: the checkpoint was saved without compression"
  end
  if saved.world_size ~= d.world then
    zero_all(sh)
    return fmt("compression residuals reset to zero: saved on %s ranks, now %d (each rank's residual covers its "
      .. "own gradient)", tostring(saved.world_size), d.world)
  end
  local by_name, rec = {}, nil
  for _, e in ipairs(units_of(sh)) do by_name[e.u.name] = e.u end
  for _, r in ipairs(saved.files or {}) do if r.rank == d.rank then rec = r end end
  local fits = rec ~= nil
  for _, b in ipairs(rec and rec.units or {}) do
    local u = by_name[b.name]
    if not u or u.padded ~= b.count then fits = false end
  end
  local all = require("fsdp.distributed")._borrow(d.comm):min({ fits and 1 or 0 })[1] == 1
  if not all then
    zero_all(sh)
    return "compression residuals reset to zero: the checkpoint's units differ from this model's (another wrap?)"
  end
  local vals = together(d.comm, function() return read_mine(dir, rec, by_name) end)
  zero_all(sh)
  for _, v in ipairs(vals) do compress.set_residual(sh, v.u.index, v.t) end
  if saved.grads ~= mine.grads then
    return fmt("compression residuals restored (saved with %s, now %s)", tostring(saved.grads), mine.grads)
  end
  return nil
end

return M
