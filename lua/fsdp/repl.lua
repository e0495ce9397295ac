-- fsdp.repl: the interactive prompt, in the manner of Torch7's th.
--
-- Each input is first tried as `return <input>` so that expressions print
-- their values; input that ends early (an open `for`, `function`, string)
-- continues on the next line under ">> ". Errors print with a traceback and
-- the loop goes on (DESIGN.md, "Decided" 2: the REPL survives every user
-- mistake). Line editing and history come from readline when the launcher
-- was built with it and stdin is a terminal.

local ffi = require "ffi"

local M = {}

ffi.cdef [[ int isatty(int fd); ]]

-- The launcher's readline wrappers, absent when built without readline.
local rl = pcall(function()
  ffi.cdef [[
    char *fsdp_repl_readline(const char *prompt);
    void fsdp_repl_add_history(const char *line);
    void fsdp_repl_free(char *line);
    int fsdp_repl_read_history(const char *path);
    int fsdp_repl_write_history(const char *path);
  ]]
  return ffi.C.fsdp_repl_readline
end) and ffi.C or nil

M.PROMPT, M.CONTINUE = "fsdp> ", ">> "
local MAX_ITEMS = 40

-- ---- printing values ----

local function is_tensor(v)
  return type(v) == "cdata" and package.loaded.fsdp and package.loaded.fsdp.is_tensor(v)
end

local function short(v)
  if type(v) == "string" then return string.format("%q", v) end
  if is_tensor(v) then return "tensor " .. v:describe() end
  if type(v) == "table" then
    local m = getmetatable(v)
    if m and m.__tostring then return tostring(v) end
    return "{...}"
  end
  return tostring(v)
end

local function key_repr(k)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") then return k end
  return "[" .. short(k) .. "]"
end

-- One level of a table: the array part in order, then the other keys sorted.
local function table_repr(t)
  local m = getmetatable(t)
  if m and m.__tostring then return tostring(t) end
  local parts, n = {}, #t
  for i = 1, math.min(n, MAX_ITEMS) do parts[#parts + 1] = short(t[i]) end
  local keys = {}
  for k in pairs(t) do
    if not (type(k) == "number" and k >= 1 and k <= n and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b)
    if type(a) == type(b) and (type(a) == "number" or type(a) == "string") then return a < b end
    return type(a) < type(b)
  end)
  for _, k in ipairs(keys) do
    if #parts >= MAX_ITEMS then break end
    parts[#parts + 1] = key_repr(k) .. " = " .. short(t[k])
  end
  if n + #keys > #parts then parts[#parts + 1] = "..." end
  return "{" .. table.concat(parts, ", ") .. "}"
end

function M.repr(v)
  if type(v) == "table" then return table_repr(v) end
  return tostring(v)
end

local function print_results(n, ...)
  if n == 0 then return end
  local out, multiline = {}, false
  for i = 1, n do
    out[i] = M.repr((select(i, ...)))
    if out[i]:find("\n", 1, true) then multiline = true end
  end
  io.stdout:write(table.concat(out, multiline and "\n" or "\t"), "\n")
end

-- ---- evaluation ----

local PACKED = {}
local function pack_results(...) return setmetatable({ n = select("#", ...), ... }, PACKED) end

local EXIT = setmetatable({}, { __tostring = function() return "exit" end })
local exit_code

local function handler(e)
  if e == EXIT then return e end
  local msg = type(e) == "string" and e or M.repr(e)
  -- start at the raising function, or above it when that is error() itself
  local info = debug.getinfo(2, "S")
  local tb = debug.traceback(msg, (info and info.what == "C") and 3 or 2)
  -- Frames from the REPL's own loop are noise.
  return (tb:gsub("\n%s*%[C%]: in function 'xpcall'.*$", ""))
end

local function report(ok, ...)
  if ok then
    local r = ...
    if type(r) == "table" and getmetatable(r) == PACKED then print_results(r.n, unpack(r, 1, r.n)) end
  elseif (...) == EXIT then
    return true
  else
    io.stdout:flush()
    io.stderr:write(tostring((...)), "\n")
  end
  io.stdout:flush()
  return false
end

-- Compiles the input; "incomplete" when more lines may finish it. An
-- expression is evaluated inside a call to pack, not as `return expr`:
-- that would be a tail call, and an error in it would lose its line.
local function compile(src)
  local f = loadstring("local pack = ...; return pack(" .. src .. "\n)", "=stdin")
  if f then return f end
  local err
  f, err = loadstring(src, "=stdin")
  if f then return f end
  if err:sub(-7) == "'<eof>'" then return nil, "incomplete" end
  return nil, err
end

-- ---- input ----

local function history_path()
  local home = os.getenv("HOME")
  return home and home ~= "" and (home .. "/.fsdp_lua_history") or nil
end

local function make_reader(tty)
  if tty and rl then
    local hist = history_path()
    if hist then pcall(rl.fsdp_repl_read_history, hist) end
    local function read(prompt)
      local p = rl.fsdp_repl_readline(prompt)
      if p == nil then return nil end
      local s = ffi.string(p)
      rl.fsdp_repl_free(p)
      return s
    end
    local function remember(line) rl.fsdp_repl_add_history(line) end
    local function close()
      if hist then pcall(rl.fsdp_repl_write_history, hist) end   -- best effort
    end
    return read, remember, close
  end
  local function read(prompt)
    if tty then
      io.stdout:write(prompt)
      io.stdout:flush()
    end
    return io.stdin:read("*l")
  end
  return read, function() end, function() end
end

--- Runs the loop until EOF (Ctrl-D) or exit()/quit(). opts.tty forces the
-- terminal behaviour (prompts, readline) on or off.
function M.run(opts)
  local tty = opts and opts.tty
  if tty == nil then tty = ffi.C.isatty(0) == 1 end
  local fsdp = require "fsdp"
  _G.fsdp = fsdp
  local function leave(code)
    exit_code = code
    error(EXIT, 0)
  end
  _G.exit, _G.quit = leave, leave

  local read, remember, close = make_reader(tty)
  if tty then
    print(string.format("fsdp-lua %s on %s; `fsdp` is loaded. exit() or Ctrl-D leaves.",
                        fsdp.version(), jit and jit.version or _VERSION))
  end

  local buf
  while true do
    local line = read(buf and M.CONTINUE or M.PROMPT)
    if line == nil then
      if tty then io.stdout:write("\n") end
      break
    end
    buf = buf and (buf .. "\n" .. line) or line
    if buf:match("^%s*$") then
      buf = nil
    else
      local f, err = compile(buf)
      if err ~= "incomplete" then
        remember(buf)
        buf = nil
        if f then
          if report(xpcall(f, handler, pack_results)) then break end
        else
          io.stdout:flush()
          io.stderr:write(err, "\n")
        end
      end
    end
  end
  close()
  if exit_code and exit_code ~= 0 and exit_code ~= true then os.exit(exit_code) end
end

return M
