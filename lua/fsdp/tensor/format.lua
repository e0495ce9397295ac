-- fsdp.tensor.format: how a tensor prints (print(t), tostring(t)): Torch7's
-- layout, one 2-D block per index of the leading dims, long dims
-- summarized with "...", one number format for all shown values, and a
-- footer naming dtype, shape and device.

local core = require "fsdp.core"
local q = require "fsdp.tensor.query"

local dtype_names, device_names = core.dtype_names, core.device_names
local floor, abs = math.floor, math.abs
local fmt, concat = string.format, table.concat
local shape_of, numel, dtype_of, device_id_of, element_reader = q.shape_of, q.numel, q.dtype_of, q.device_id_of,
  q.element_reader

local EDGE, SUMMARIZE_OVER = 3, 1000

-- 0-based indices to show along a dim; false marks the "..." gap.
local function shown(n, summarize)
  local l = {}
  if summarize and n > 2 * EDGE then
    for i = 0, EDGE - 1 do l[#l + 1] = i end
    l[#l + 1] = false
    for i = n - EDGE, n - 1 do l[#l + 1] = i end
  else
    for i = 0, n - 1 do l[i + 1] = i end
  end
  return l
end

local function is_finite(v) return v == v and v ~= math.huge and v ~= -math.huge end

-- One format for all shown values: integers as such, else fixed or
-- scientific with 4 decimals.
local function chooser(values, int_dtype)
  local all_int, maxabs, minabs = true, 0, math.huge
  for i = 1, #values do
    local v = values[i]
    if is_finite(v) then
      local a = abs(v)
      if v ~= floor(v) then all_int = false end
      if a > maxabs then maxabs = a end
      if a > 0 and a < minabs then minabs = a end
    end
  end
  local f
  if int_dtype or (all_int and maxabs < 1e10) then
    f = "%d"
  elseif maxabs >= 1e5 or minabs < 1e-4 then
    f = "%.4e"
  else
    f = "%.4f"
  end
  return function(v)
    if v ~= v then return "nan" end
    if v == math.huge then return "inf" end
    if v == -math.huge then return "-inf" end
    return fmt(f, v)
  end
end

local function format_tensor(t)
  local dims = shape_of(t)
  local nd, n, dt = #dims, numel(t), dtype_of(t)
  local shape_txt = concat(dims, ", ")
  local dev = device_names[device_id_of(t)]
  local footer = fmt("[%s tensor of shape (%s) on %s]", dtype_names[dt], shape_txt, dev)
  if n == 0 then return "[]\n" .. footer end
  local read, strides = element_reader(t)
  if nd == 0 then return chooser({ read(0) }, dt >= 2)(read(0)) .. "\n" .. footer end

  local summarize = n > SUMMARIZE_OVER
  local lists = {}
  for d = 1, nd do lists[d] = shown(dims[d], summarize) end

  -- Blocks: one 2-D (or 1-D) matrix per shown index of the leading dims.
  local blocks, values = {}, {}
  local function row_values(off)
    local row = {}
    local l, s = lists[nd], strides[nd]
    for k = 1, #l do
      if l[k] then
        local v = read(off + l[k] * s)
        row[k] = v
        values[#values + 1] = v
      else
        row[k] = false
      end
    end
    return row
  end
  local function walk(d, off, prefix)
    if d >= nd - 1 then
      local rows = {}
      if nd == 1 then
        rows[1] = row_values(off)
      else
        local l, s = lists[nd - 1], strides[nd - 1]
        for k = 1, #l do rows[k] = l[k] and row_values(off + l[k] * s) or false end
      end
      blocks[#blocks + 1] = { header = prefix, rows = rows }
      return
    end
    local l = lists[d]
    for k = 1, #l do
      if l[k] then
        walk(d + 1, off + l[k] * strides[d], prefix .. (l[k] + 1) .. ",")
      else
        blocks[#blocks + 1] = { header = false }
      end
    end
  end
  walk(1, 0, "")

  local format = chooser(values, dt >= 2)
  local width = 0
  for i = 1, #values do
    local w = #format(values[i])
    if w > width then width = w end
  end
  local function render_row(row)
    local cells = {}
    for k = 1, #row do
      local s = row[k] and format(row[k]) or "..."
      cells[k] = string.rep(" ", width - #s) .. s
    end
    return " " .. concat(cells, "  ")
  end

  local lines = {}
  for b = 1, #blocks do
    local blk = blocks[b]
    if not blk.header and not blk.rows then
      if nd > 2 then lines[#lines + 1] = "" end
      lines[#lines + 1] = "..."
    else
      if nd > 2 then
        if #lines > 0 then lines[#lines + 1] = "" end
        lines[#lines + 1] = "(" .. blk.header .. ".,.) = "
      end
      for r = 1, #blk.rows do
        lines[#lines + 1] = blk.rows[r] and render_row(blk.rows[r]) or " ..."
      end
    end
  end
  lines[#lines + 1] = footer
  return concat(lines, "\n")
end

return { format_tensor = format_tensor }
