-- fsdp.repl: the interactive prompt, in the manner of Torch7's th.
--
-- Each input is first tried as `return <input>` so that expressions print
-- their values; input that ends early (an open `for`, `function`, string)
-- continues on the next line under ">> ". Errors print with a traceback and
-- the loop goes on (DESIGN.md, decision 2: the REPL survives every user
-- mistake). Line editing, history and Tab completion (globals, fields,
-- methods) come from readline when the launcher was built with it and stdin
-- is a terminal. Ctrl-C interrupts the running chunk, or clears the line.
-- help(f) prints the comment above f's definition.
--
-- Across ranks (`mpirun -np N fsdp-lua`): rank 0 reads each complete chunk
-- and sends it to every rank; every rank runs it; rank 0 prints the values
-- and every rank's error, marked with its rank; then all go on. The launcher
-- carries this on a communicator of its own (launcher/main.c). A chunk that
-- fails on some ranks only may leave the others waiting in a collective the
-- failed ranks never join: those waits give up at once (fsdp_comm_abandon)
-- and the chunk fails there too. The collective itself still waits on the
-- comm thread, so after such a chunk the ranks bring their collectives back
-- in step (fsdp_repl_rejoin): each cancels, with no data moved, what the
-- others wait for and it never issued, until every comm thread is idle and
-- the sequence numbers agree. Should that not finish within
-- $FSDP_REPL_REJOIN_SECONDS (default 10; 0: do not try), the REPL ends the
-- job with a message saying which rank failed and why, rather than hang.
-- A chunk that never ends on some rank (an endless loop) is noticed by the
-- ranks that finished it: after $FSDP_REPL_REJOIN_SECONDS the lowest of them
-- names the rank and interrupts it, as Ctrl-C would, and the session goes
-- on; one that still has not finished as long again ends the job with that
-- message (launcher/repl_ranks.c). exit() on some ranks only ends the REPL
-- on every rank, with that status and a line naming the ranks.
-- Ctrl-C at mpirun's terminal reaches rank 0 as input (it turns the
-- terminal's signal keys off while the REPL runs, and a guard process turns
-- them back on should rank 0 die), which interrupts the chunk on every rank
-- or drops the line being typed; Ctrl-\ ends the job. No line editing or
-- Tab there: mpirun, not rank 0, reads the terminal.

local ffi = require "ffi"

local M = {}

ffi.cdef [[ int isatty(int fd); ]]

-- The launcher's functions (launcher/fsdp_repl.h, through the generated
-- lua/fsdp/repl_cdef.lua); a host program other than fsdp-lua has none.
pcall(ffi.cdef, require "fsdp.repl_cdef")
local function has(name) return pcall(function() return ffi.C[name] end) end
-- the readline wrappers: absent when the launcher was built without readline
local rl = has("fsdp_repl_readline") and ffi.C or nil
-- Ctrl-C handling and the channel between ranks
local launcher = has("fsdp_repl_ctl_start") and ffi.C or nil
local SIGINT_DEFAULT, SIGINT_CHUNK, SIGINT_READING = 0, 1, 2

-- How long the ranks may take to bring their collectives back in step
-- after a chunk that failed on some of them.
local function rejoin_seconds()
  local v = os.getenv("FSDP_REPL_REJOIN_SECONDS")
  local n = tonumber(v)
  if v and v ~= "" and not (n and n >= 0) then
    error("fsdp.repl: FSDP_REPL_REJOIN_SECONDS=" .. v .. ": expected a number of seconds >= 0", 0)
  end
  return n or 10
end

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

-- exit(code)'s status, as os.exit reads code (nil or true: 0, false: 1).
local function exit_status(code)
  if code == nil or code == true or code == "true" or code == "nil" then return 0 end
  if code == false or code == "false" then return 1 end
  return math.floor(tonumber(code) or 1)
end

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
    local flag = ffi.new("int[1]")
    local function read(prompt)
      local p = rl.fsdp_repl_readline(prompt, flag)
      if p == nil then return nil end
      local s = ffi.string(p)
      rl.fsdp_repl_free(p)
      if flag[0] ~= 0 then return s, "interrupted" end
      return s
    end
    jit.off(read)   -- completion calls back into Lua from inside readline
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


-- ---- Tab completion ----

local KEYWORDS = { "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if",
                   "in", "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while" }

-- The fields a value offers: a table's keys (and its __index table's), a
-- tensor's methods.
local function fields_of(v, methods_only)
  local out, seen = {}, {}
  local function add(k, val)
    if type(k) == "string" and k:match("^[%a_][%w_]*$") and not seen[k] then
      if not methods_only or type(val) == "function" then
        seen[k] = true
        out[#out + 1] = k
      end
    end
  end
  local t = v
  for _ = 1, 4 do   -- a few levels of __index tables
    if type(t) == "table" then
      for k, val in pairs(t) do add(k, val) end
      local m = getmetatable(t)
      t = type(m) == "table" and type(m.__index) == "table" and m.__index or nil
    elseif is_tensor(t) then
      for k, val in pairs(require("fsdp.tensor").methods) do add(k, val) end
      t = nil
    else
      break
    end
  end
  table.sort(out)
  return out
end

--- repl.complete(word) -> candidates for the word before the cursor:
-- globals and keywords, `a.b.` fields, `a:` methods. Nothing is called:
-- only plain lookups along the dotted name.
function M.complete(word)
  local base, sep, part = word:match("^(.-)([%.:])([%w_]*)$")
  local out = {}
  if not base then
    if not word:match("^[%a_][%w_]*$") then return out end
    for _, k in ipairs(fields_of(_G)) do
      if k:sub(1, #word) == word then out[#out + 1] = k end
    end
    for _, k in ipairs(KEYWORDS) do
      if k:sub(1, #word) == word and k ~= word then out[#out + 1] = k end
    end
    return out
  end
  if not base:match("^[%a_][%w_]*[%w_%.]*$") then return out end
  local v = _G
  for name in base:gmatch("[^%.]+") do
    local ok, nv = pcall(function() return v[name] end)
    if not ok or nv == nil then return out end
    v = nv
  end
  for _, k in ipairs(fields_of(v, sep == ":")) do
    if k:sub(1, #part) == part then out[#out + 1] = base .. sep .. k end
  end
  return out
end

local completer_cb   -- kept alive as long as readline may call it
local function install_completer()
  if not rl or completer_cb then return end
  completer_cb = ffi.cast("void (*)(const char *, int, int)", function(line, start, stop)
    local ok, list = pcall(M.complete, ffi.string(line):sub(start + 1, stop))
    if ok then
      for _, c in ipairs(list) do rl.fsdp_repl_add_completion(c) end
    end
  end)
  rl.fsdp_repl_set_completer(completer_cb)
end

-- ---- help ----

local source_lines = {}
local function lines_of(path)
  if source_lines[path] == nil then
    local f = io.open(path, "r")
    local list = false
    if f then
      list = {}
      for l in f:lines() do list[#list + 1] = l end
      f:close()
    end
    source_lines[path] = list
  end
  return source_lines[path] or nil
end

--- repl.doc(f) -> the definition line and the comment just above it, or
-- nil (C functions, code typed at the prompt).
function M.doc(f)
  if type(f) ~= "function" then return nil end
  local info = debug.getinfo(f, "S")
  if info.what ~= "Lua" or info.source:sub(1, 1) ~= "@" then return nil end
  local lines = lines_of(info.source:sub(2))
  if not lines or not lines[info.linedefined] then return nil end
  local doc, i = {}, info.linedefined - 1
  while i >= 1 and lines[i]:match("^%s*%-%-") do
    table.insert(doc, 1, (lines[i]:gsub("^%s*%-%-%-?%s?", "")))
    i = i - 1
  end
  local head = lines[info.linedefined]:gsub("^%s+", "")
  return head .. (#doc > 0 and ("\n" .. table.concat(doc, "\n")) or "")
end

--- help(value): a function's definition and comment; for a table, its
-- functions with the first line of each comment.
function M.help(v)
  if type(v) == "function" then
    local d = M.doc(v)
    print(d or "no documentation (a C function, or defined at the prompt)")
  elseif type(v) == "table" or is_tensor(v) then
    local names = fields_of(v)
    local rows = {}
    for _, k in ipairs(names) do
      local val = is_tensor(v) and require("fsdp.tensor").methods[k] or v[k]
      if type(val) == "function" then
        local d = M.doc(val)
        local first = d and d:match("\n([^\n]*)") or ""
        rows[#rows + 1] = string.format("  %-24s %s", k, first)
      end
    end
    print(#rows > 0 and table.concat(rows, "\n") or ("a " .. type(v) .. " without functions"))
  else
    print("help(f): give a function or a table, e.g. help(fsdp.randn), help(fsdp)")
  end
end

-- ---- across ranks ----

local out_p, out_n = ffi.new("char *[1]"), ffi.new("int64_t[1]")

-- Rank 0's string (nil: end of input) on every rank.
local function bcast(s)
  if launcher.fsdp_repl_bcast(s, s and #s or -1, out_p, out_n) ~= 0 then
    error("fsdp.repl: rank " .. tostring(require("fsdp").rank()) .. ": sending the input between ranks failed", 0)
  end
  local n = tonumber(out_n[0])
  local r = n >= 0 and ffi.string(out_p[0], n) or nil
  launcher.fsdp_repl_free(out_p[0])
  return r
end

-- Ends a chunk on every rank: { { abandoned = n, record = s }, ... } by rank + 1.
local function chunk_end(err, record)
  if launcher.fsdp_repl_chunk_end(err, record, #record, out_p, out_n) ~= 0 then
    error("fsdp.repl: exchanging chunk outcomes between ranks failed", 0)
  end
  local p, total, at, list = out_p[0], tonumber(out_n[0]), 0, {}
  while at < total do
    local len = tonumber(ffi.cast("int64_t *", p + at)[0])
    local abandoned = tonumber(ffi.cast("int64_t *", p + at + 8)[0])
    list[#list + 1] = { abandoned = abandoned, record = ffi.string(p + at + 16, len - 8) }
    at = at + 8 + len
  end
  launcher.fsdp_repl_free(p)
  return list
end

-- Whether rank 0's user sits at a terminal: under mpirun its stdin is a
-- pipe from mpirun, so look at mpirun's own stdin (FSDP_REPL_TTY=0/1 decides).
local function mpirun_on_terminal()
  local env = os.getenv("FSDP_REPL_TTY")
  if env and env ~= "" then return env ~= "0" end
  ffi.cdef [[ int getppid(void); long readlink(const char *path, char *buf, size_t n); ]]
  local buf = ffi.new("char[256]")
  local n = ffi.C.readlink("/proc/" .. ffi.C.getppid() .. "/fd/0", buf, 255)
  local target = n > 0 and ffi.string(buf, n) or ""
  return target:match("^/dev/pts/") ~= nil or target:match("^/dev/tty") ~= nil
end

-- "[rank 1] msg", or "[ranks 0,1] msg" for one message from several ranks.
local function report_errors(list)
  local order, by = {}, {}
  for r, e in ipairs(list) do
    if e.record:sub(1, 1) == "E" then
      local msg = e.record:sub(2)
      if not by[msg] then by[msg] = {}; order[#order + 1] = msg end
      table.insert(by[msg], r - 1)
    end
  end
  -- on stdout: under mpirun stdout and stderr travel apart, and the
  -- messages must come before the next prompt
  for _, msg in ipairs(order) do
    local ranks = by[msg]
    local who = #ranks == #list and #list > 1 and "all ranks" or
                ((#ranks > 1 and "ranks " or "rank ") .. table.concat(ranks, ","))
    io.stdout:write("[", who, "] ", msg, "\n")
  end
  io.stdout:flush()
end

-- The ranks could not bring their collectives back in step: rank 0 says
-- why, and every rank leaves without MPI_Finalize (its comm thread may be
-- stuck in a collective). Not MPI_Abort: that can tear the job down before
-- mpirun has forwarded rank 0's last output; a rank that exits is drained
-- first. Rank 0 leaves first, once its message is out.
pcall(ffi.cdef, [[ void _exit(int code); ]])
pcall(ffi.cdef, [[ unsigned int sleep(unsigned int s); ]])
local function end_job(rank, failed, gave_up)
  if rank == 0 then
    io.stdout:write(string.format(
      "fsdp-lua: the chunk failed on rank(s) %s while rank %s waited in a collective; the ranks could not bring "
      .. "their collectives back in step (FSDP_REPL_REJOIN_SECONDS), so they cannot go on together: ending the job\n",
      #failed > 0 and table.concat(failed, ",") or "?", gave_up or "?"))
    io.stdout:flush()
    io.stderr:flush()
    launcher.fsdp_repl_tty_end()   -- the terminal as it was (else the guard does it)
  end
  launcher.fsdp_repl_ctl_barrier()
  if rank ~= 0 then ffi.C.sleep(5) end
  ffi.C._exit(1)
end

--- Runs the loop until EOF (Ctrl-D) or exit()/quit(). opts.tty forces the
-- terminal behaviour (prompts, readline) on or off.
function M.run(opts)
  local fsdp = require "fsdp"
  _G.fsdp = fsdp
  _G.help = M.help
  local world = launcher and launcher.fsdp_repl_ctl_start() or 1
  if world < 0 then error("fsdp.repl: cannot open the channel between ranks", 0) end
  local rejoin_limit = world > 1 and rejoin_seconds()
  -- a rank that never ends a chunk is interrupted (0: the job ends) after as long
  if world > 1 then launcher.fsdp_repl_set_watchdog(rejoin_limit) end
  local rank = world > 1 and fsdp.rank() or 0
  local tty = opts and opts.tty
  if tty == nil then
    if world == 1 then tty = ffi.C.isatty(0) == 1 else tty = rank == 0 and mpirun_on_terminal() end
  end
  if rank ~= 0 then tty = false end
  local function leave(code)
    exit_code = code
    error(EXIT, 0)
  end
  _G.exit, _G.quit = leave, leave

  local read, remember, close = make_reader(tty and (world == 1))
  local prompt_only = tty and world > 1   -- prompts, but no readline: mpirun owns the terminal
  -- Ctrl-C across ranks: rank 0 takes it from the terminal (launcher/main.c)
  local tty_keys = prompt_only and launcher.fsdp_repl_tty_begin() == 1
  if tty_keys then
    local flag = ffi.new("int[1]")
    read = function(prompt)
      local p = launcher.fsdp_repl_tty_readline(prompt, flag)
      if p == nil then return nil end
      local s = ffi.string(p)
      launcher.fsdp_repl_free(p)
      if flag[0] ~= 0 then
        io.stdout:write("\n")   -- the terminal echoed ^C
        return s, "interrupted"
      end
      return s
    end
  elseif prompt_only then
    read = function(prompt)
      io.stdout:write(prompt)
      io.stdout:flush()
      return io.stdin:read("*l")
    end
  end
  local use_rl = tty and world == 1 and rl ~= nil
  if use_rl then install_completer() end
  if tty then
    print(string.format("fsdp-lua %s on %s%s; `fsdp` is loaded. help(f), %sCtrl-C; exit() or Ctrl-D leaves.",
                        fsdp.version(), jit and jit.version or _VERSION,
                        world > 1 and string.format(", %d ranks", world) or "", use_rl and "Tab, " or ""))
  end
  local sigint = launcher and launcher.fsdp_repl_sigint or function() return 0 end
  -- while reading: readline clears the line; plain reads just go on
  local reading_mode = use_rl and SIGINT_READING or (tty and 3 or SIGINT_DEFAULT)
  -- Across ranks a SIGINT may come from the listener (rank 0's Ctrl-C) just
  -- after a chunk ended: between chunks it must not end the process.
  local idle_mode = world > 1 and 3 or SIGINT_DEFAULT
  if world > 1 then reading_mode = 3 end

  -- Rank 0: the next complete chunk, or nil at the end of input.
  local function read_chunk()
    local buf
    while true do
      sigint(reading_mode)
      local line, why = read(buf and M.CONTINUE or M.PROMPT)
      if line == nil then
        if tty then io.stdout:write("\n") end
        return nil
      end
      if why == "interrupted" then
        buf = nil
      else
        buf = buf and (buf .. "\n" .. line) or line
        if buf:match("^%s*$") then
          buf = nil
        else
          local f, err = compile(buf)
          if err ~= "incomplete" then
            remember(buf)
            if f then return buf end
            buf = nil
            io.stdout:flush()
            io.stderr:write(err, "\n")
          end
        end
      end
    end
  end

  local chunk_no, done = 0, false
  while not done do
    local src
    chunk_no = chunk_no + 1
    -- the chunk's number is set before rank 0 sends it, so that no rank can
    -- fail it (and tell the others) before every rank listens for that
    if world > 1 then launcher.fsdp_repl_chunk_begin(chunk_no) end
    if rank == 0 then src = read_chunk() end
    if world > 1 then src = bcast(src) end
    if src == nil then break end
    local f, err = compile(src)
    -- Compiled loops never look at hooks, so Ctrl-C could not stop
    -- `while true do end`: the chunk's own code (not the library) runs
    -- interpreted, which costs little at a prompt.
    if f and jit then jit.off(f, true) end
    -- Ctrl-C raises "interrupted" at the next Lua instruction while SIGINT
    -- is in chunk mode, so the switches in and out of that mode happen
    -- inside a protected call too: an interrupt just before the chunk or
    -- just after it cannot escape the loop (across ranks that rank would
    -- leave, and the others wait for it in fsdp_repl_chunk_end).
    local res, seen
    local in_chunk = function()
      sigint(SIGINT_CHUNK)
      if f then res = pack_results(xpcall(f, handler, pack_results))
      else res = pack_results(false, err) end
      seen = sigint(idle_mode)
    end
    if not pcall(in_chunk) then
      res = res or pack_results(false, "interrupted")
      repeat until pcall(sigint, idle_mode)   -- once it returns, no hook can raise any more
      seen = 1
    end
    -- the terminal echoed the ^C that stopped the chunk: a line of its own
    if seen == 1 and tty_keys then io.stdout:write("\n") end
    if world == 1 then
      done = report(unpack(res, 1, res.n))
    else
      local ok, e = res[1], res[2]
      local record = ok and "O" or e == EXIT and ("X" .. tostring(exit_code or 0)) or ("E" .. tostring(e))
      -- the notice to the other ranks: the message without its traceback
      local list = chunk_end((not ok and e ~= EXIT) and tostring(e):match("^[^\n]*") or nil, record)
      if rank == 0 and ok then report(unpack(res, 1, res.n)) end
      if rank == 0 then report_errors(list) end
      local failed, gave_up, exited = {}, nil, {}
      for r, x in ipairs(list) do
        if x.abandoned > 0 then gave_up = gave_up or r - 1 end
        if x.record:sub(1, 1) == "E" and x.abandoned == 0 then failed[#failed + 1] = r - 1 end
        if x.record:sub(1, 1) == "X" then
          done = true
          exited[#exited + 1] = r - 1
          exit_code = exit_code or exit_status(x.record:sub(2))
        end
      end
      -- exit() on some ranks only: every rank leaves with that status, and says why
      if #exited > 0 and #exited < world and rank == 0 then
        io.stdout:write(string.format("fsdp-lua: rank%s %s called exit(%s): ending the REPL on every rank (exit "
          .. "status %d)\n", #exited > 1 and "s" or "", table.concat(exited, ","), list[exited[1] + 1].record:sub(2),
          exit_status(exit_code)))
        io.stdout:flush()
      end
      -- a chunk that failed somewhere may leave collectives waiting for it
      if rejoin_limit == 0 then
        if gave_up then end_job(rank, failed, gave_up) end
      elseif gave_up or #failed > 0 then
        if launcher.fsdp_repl_rejoin(rejoin_limit) < 0 then end_job(rank, failed, gave_up) end
        -- Unless every rank failed on its own, the ranks' autograd tapes now
        -- differ (a forward ran on some ranks only, or a backward stopped
        -- halfway), and the collectives of a later backward would not
        -- match: every rank starts afresh.
        -- Units too: a chunk that failed under no_grad leaves no tape but
        -- units gathered (or gathers issued) on some ranks only.
        if gave_up or #failed < world then
          local n = fsdp.autograd.tape_size()
          if n > 0 then fsdp.tape_clear() end
          local ok, e = pcall(fsdp.distributed._reshard_all)
          if not ok then
            io.stderr:write("fsdp-lua: rank ", rank, ": resharding after the failed chunk: ", tostring(e), "\n")
            end_job(rank, failed, gave_up)
          end
          n = fsdp.distributed.max(n)
          if rank == 0 and n > 0 then
            io.stdout:write("[all ranks] the autograd tape was cleared: after a chunk that failed on some ranks "
                            .. "the ranks' tapes differ\n")
            io.stdout:flush()
          end
        end
      end
    end
  end
  close()
  if tty_keys then launcher.fsdp_repl_tty_end() end
  if world > 1 then launcher.fsdp_repl_ctl_stop() end
  sigint(SIGINT_DEFAULT)
  -- the status for the launcher to return (every rank leaves alike: not os.exit, which aborts the job)
  if exit_code ~= nil and exit_status(exit_code) ~= 0 then return exit_status(exit_code) end
end

return M
