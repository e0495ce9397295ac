-- fsdp.progress: a one-line progress bar for long work (checkpoint save,
-- load, export, import; shard conversion), with bytes and rate, drawn on
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

pcall(ffi.cdef, "int isatty(int fd);")

local M = {}

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

--- progress.line(label, done, total, seconds) -> the bar's text, e.g.
-- "export [#########.....]  45% 1.2 GiB / 2.6 GiB 310.4 MiB/s".
function M.line(label, done, total, seconds)
  local frac = total > 0 and math.min(1, done / total) or 1
  local cells = math.floor(frac * M.WIDTH + 0.5)
  local rate = seconds > 0 and done / seconds or 0
  return string.format("%s [%s%s] %3d%% %s / %s %s/s", label, string.rep("#", cells),
                       string.rep(".", M.WIDTH - cells), math.floor(frac * 100), size(done), size(total), size(rate))
end

--- progress.bar(label) -> function(done, total), or nil when not enabled.
-- Redraws at most every INTERVAL seconds; done == total draws the final
-- state and ends the line.
function M.bar(label)
  if not M.enabled() then return nil end
  local t0, last, finished = timer.now(), -math.huge, false
  return function(done, total)
    if finished then return end
    local now = timer.now()
    local over = done >= total
    if not over and now - last < M.INTERVAL then return end
    last = now
    io.stderr:write("\r", M.line(label, done, total, now - t0), over and "\n" or "")
    io.stderr:flush()
    finished = over
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
