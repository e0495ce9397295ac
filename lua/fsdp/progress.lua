-- fsdp.progress: a one-line progress bar for long work (checkpoint save,
-- load, export, import; shard conversion; the planner's steps), with bytes
-- (or a count of steps) and rate, drawn on
-- stderr when it is a terminal; nothing at all otherwise (logs and pipes
-- stay clean).
--
--   local progress = require "fsdp.progress"
--   local bar = progress.bar("export")           -- nil when stderr is not a terminal
--   bar(done_bytes, total_bytes) ... bar(total, total)   -- ends the line
--   fsdp.save(dir, state, { progress = progress.reporter() })
--
-- progress.reporter() is the function(op, done, total) that the checkpoint
-- calls take as opts.progress, or nil when there is nothing to draw on;
-- they use it by default on rank 0. FSDP_PROGRESS=0 turns bars off,
-- FSDP_PROGRESS=1 forces them on (for tests).

local ffi = require "ffi"
local timer = require "fsdp.timer"

local M = {}

pcall(ffi.cdef, "int isatty(int fd);")
pcall(ffi.cdef, "struct fsdp_winsize { unsigned short row, col, xpixel, ypixel; }; int ioctl(int fd, unsigned long req, ...);")

-- What the bars left on stderr's current line (columns), whichever bar drew
-- it: a bar that starts where another stopped early covers that one too.
local on_line = 0

-- stderr's terminal width, or nil when it is not a terminal (or unknown).
local function columns()
  if ffi.C.isatty(2) ~= 1 then return nil end
  local ok, ws = pcall(ffi.new, "struct fsdp_winsize")
  if not ok then return nil end
  local TIOCGWINSZ = 0x5413   -- Linux
  if ffi.C.ioctl(2, TIOCGWINSZ, ws) ~= 0 or ws.col == 0 then return nil end
  return ws.col
end

--- progress.redraw(text[, final]) -> the bytes that replace stderr's current
-- line with text: a carriage return, the text (cut to the terminal's width,
-- so that it never wraps), spaces over whatever longer text a bar left there
-- and, on a terminal, an erase to the end of the line; final ends the line.
function M.redraw(text, final)
  local cols = columns()
  if cols and #text > cols - 1 then text = text:sub(1, cols - 1) end
  local out = "\r" .. text .. string.rep(" ", on_line - #text) .. (cols and "\27[K" or "") .. (final and "\n" or "")
  on_line = final and 0 or math.max(#text, 0)
  return out
end


M.WIDTH = 30          -- bar cells
M.INTERVAL = 0.1      -- seconds between redraws

--- progress.enabled() -> whether bars are drawn (stderr a terminal, or FSDP_PROGRESS=1).
function M.enabled()
  local env = os.getenv("FSDP_PROGRESS")
  if env == "0" then return false end
  if env == "1" then return true end
  return ffi.C.isatty(2) == 1
end

local function size(b)
  if b >= 2 ^ 30 then return string.format("%.2f GiB", b / 2 ^ 30) end
  if b >= 2 ^ 20 then return string.format("%.1f MiB", b / 2 ^ 20) end
  if b >= 2 ^ 10 then return string.format("%.1f KiB", b / 2 ^ 10) end
  return string.format("%d B", b)
end
M.size = size

-- a count with at most two decimals: 2, 0.5, 1.25
local function count(x) return (string.format("%.2f", x):gsub("%.?0+$", "")) end

--- progress.line(label, done, total, seconds[, unit]) -> the bar's text, e.g.
-- "export [#########.....]  45% 1.2 GiB / 2.6 GiB 310.4 MiB/s"; with unit
-- (a plural noun) done and total are counts of it, not bytes:
-- "plan [####..........]  25% 0.5 / 2 steps 1.25 steps/s".
function M.line(label, done, total, seconds, unit)
  local frac = total > 0 and math.min(1, done / total) or 1
  local cells = math.floor(frac * M.WIDTH + 0.5)
  local rate = seconds > 0 and done / seconds or 0
  local head = string.format("%s [%s%s] %3d%% ", label, string.rep("#", cells), string.rep(".", M.WIDTH - cells),
                             math.floor(frac * 100))
  if unit then
    return string.format("%s%s / %s %s %s %s/s", head, count(done), count(total), unit, count(rate), unit)
  end
  return string.format("%s%s / %s %s/s", head, size(done), size(total), size(rate))
end

--- progress.bar(label[, opts]) -> function(done, total), or nil when not
-- enabled. opts.unit: counts of that (e.g. "steps") instead of bytes.
-- Redraws at most every INTERVAL seconds; done == total draws the final
-- state and ends the line; done nil ends the line where it stands (the
-- work stopped early, e.g. on an error).
function M.bar(label, opts)
  if not M.enabled() then return nil end
  local unit = opts and opts.unit
  local t0, last, finished, drawn = timer.now(), -math.huge, false, false
  return function(done, total)
    if finished then return end
    if done == nil then
      if drawn then
        io.stderr:write("\n")
        on_line = 0
      end
      finished = true
      return
    end
    local now = timer.now()
    local over = done >= total
    if not over and now - last < M.INTERVAL then return end
    last = now
    local text = M.line(label, done, total, now - t0, unit)
    io.stderr:write(M.redraw(text, over))   -- covers a longer line before it (a rate that got shorter)
    io.stderr:flush()
    drawn, finished = true, over
  end
end

--- progress.reporter() -> function(op, done, total) drawing one bar per op,
-- or nil when not enabled.
function M.reporter()
  if not M.enabled() then return nil end
  local bars = {}
  return function(op, done, total)
    local b = bars[op]
    if not b then
      b = M.bar(op)
      bars[op] = b
    end
    b(done, total)
    if done >= total then bars[op] = nil end
  end
end

return M
