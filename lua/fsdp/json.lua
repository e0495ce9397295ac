-- fsdp.json: a small JSON encoder and decoder in plain Lua (no engine, no C).
--
-- Used for safetensors headers and checkpoint indexes, so it favours exact,
-- deterministic output over speed:
--   * object keys are written sorted, so the same table gives the same bytes;
--   * integers (|n| <= 2^53) are written as integers, exactly; other numbers
--     with 17 significant digits, which round-trip a double; int64/uint64
--     cdata are written exactly whatever their size;
--   * NaN and infinities are refused (JSON has no spelling for them).
--
-- Lua tables do not say whether they are arrays or objects: a table whose
-- keys are exactly 1..n (n >= 1) is an array, anything else an object, and an
-- empty table an object unless marked with json.array({}). Decoding gives
-- arrays marked that way, so they encode back as arrays. JSON null decodes to
-- the sentinel json.null (a nil would make holes in arrays).
--
--   local json = require "fsdp.json"
--   local s = json.encode({ a = { 1, 2 }, b = "x" })       -- {"a":[1,2],"b":"x"}
--   local s = json.encode(t, { indent = "  " })            -- pretty, for humans
--   local v = json.decode(s)                               -- errors name the position

local ffi = require "ffi"

local byte, char, sub, find, fmt = string.byte, string.char, string.sub, string.find, string.format
local concat, sort = table.concat, table.sort
local floor, huge = math.floor, math.huge
local type, pairs, tostring, tonumber, setmetatable, getmetatable =
      type, pairs, tostring, tonumber, setmetatable, getmetatable

local M = {}

M.null = setmetatable({}, { __tostring = function() return "json.null" end })

local array_mt = { __jsontype = "array" }
local object_mt = { __jsontype = "object" }

--- json.array(t): marks t as an array (matters for empty tables).
function M.array(t) return setmetatable(t or {}, array_mt) end
--- json.is_array(t): true for tables decoded from a JSON array (or marked).
function M.is_array(t) return getmetatable(t) == array_mt end
--- json.is_object(v): true for a table that encodes as a JSON object
-- (not an array, not json.null).
function M.is_object(v)
  return type(v) == "table" and v ~= M.null and getmetatable(v) ~= array_mt
end
--- json.object(t): marks t as an object (matters for empty tables).
function M.object(t) return setmetatable(t or {}, object_mt) end

local MAX_DEPTH = 512
local TWO53 = 2 ^ 53

-- ---- encoding ----

local escapes = {
  ['"'] = '\\"', ['\\'] = '\\\\', ['\b'] = '\\b', ['\f'] = '\\f',
  ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t',
}
for c = 0, 31 do
  local ch = char(c)
  if not escapes[ch] then escapes[ch] = fmt("\\u%04x", c) end
end
escapes["\127"] = "\\u007f"

local function encode_string(s)
  return '"' .. s:gsub('[%c"\\]', escapes) .. '"'
end

local int64_t, uint64_t = ffi.typeof("int64_t"), ffi.typeof("uint64_t")

-- The keys leading to the value being encoded, joined only for an error
-- message ("$.tensors[3].shape").
local function path_of(keys, depth)
  local p = { "$" }
  for i = 1, depth do
    local k = keys[i]
    p[#p + 1] = type(k) == "number" and ("[" .. k .. "]") or ("." .. tostring(k))
  end
  return concat(p)
end

local function encode_number(x, keys, depth)
  if x ~= x or x == huge or x == -huge then
    error("json.encode: cannot encode " .. tostring(x) .. " at " .. path_of(keys, depth), 0)
  end
  if x == floor(x) and x >= -TWO53 and x <= TWO53 then
    if x == 0 then return "0" end        -- also -0
    return fmt("%d", x)
  end
  return fmt("%.17g", x)
end

-- Decides array or object; returns "array", n or "object".
local function kind_of(t)
  local mt = getmetatable(t)
  local forced = mt and mt.__jsontype
  if forced == "array" then return "array", #t end
  if forced == "object" then return "object" end
  local n = #t
  if n == 0 then return "object" end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  if count == n then return "array", n end
  return "object"
end

local encode_value

-- keys[1..depth] is the path to t; seen guards against cycles.
local function encode_table(t, out, indent, depth, keys, seen)
  if seen[t] then error("json.encode: a table contains itself at " .. path_of(keys, depth), 0) end
  if depth >= MAX_DEPTH then
    error("json.encode: nested deeper than " .. MAX_DEPTH .. " at " .. path_of(keys, depth), 0)
  end
  seen[t] = true
  local nl, pad, pad_in, colon = "", "", "", ":"
  if indent then
    nl = "\n"
    pad = indent:rep(depth)
    pad_in = pad .. indent
    colon = ": "
  end
  local kind, n = kind_of(t)
  if kind == "array" then
    if n == 0 then
      out[#out + 1] = "[]"
    else
      out[#out + 1] = "[" .. nl
      for i = 1, n do
        out[#out + 1] = pad_in
        keys[depth + 1] = i
        encode_value(t[i], out, indent, depth + 1, keys, seen)
        out[#out + 1] = (i < n and "," or "") .. nl
      end
      out[#out + 1] = pad .. "]"
    end
  else
    local ks = {}
    for k in pairs(t) do
      if type(k) ~= "string" then
        error("json.encode: object key " .. tostring(k) .. " at " .. path_of(keys, depth) ..
              " is a " .. type(k) .. " (keys must be strings; arrays must not have holes)", 0)
      end
      ks[#ks + 1] = k
    end
    if #ks == 0 then
      out[#out + 1] = "{}"
    else
      sort(ks)
      out[#out + 1] = "{" .. nl
      for i = 1, #ks do
        local k = ks[i]
        out[#out + 1] = pad_in .. encode_string(k) .. colon
        keys[depth + 1] = k
        encode_value(t[k], out, indent, depth + 1, keys, seen)
        out[#out + 1] = (i < #ks and "," or "") .. nl
      end
      out[#out + 1] = pad .. "}"
    end
  end
  seen[t] = nil
end

encode_value = function(v, out, indent, depth, keys, seen)
  local tv = type(v)
  if tv == "string" then
    out[#out + 1] = encode_string(v)
  elseif tv == "number" then
    out[#out + 1] = encode_number(v, keys, depth)
  elseif tv == "boolean" then
    out[#out + 1] = v and "true" or "false"
  elseif v == nil or v == M.null then
    out[#out + 1] = "null"
  elseif tv == "table" then
    encode_table(v, out, indent, depth, keys, seen)
  elseif tv == "cdata" and (ffi.istype(int64_t, v) or ffi.istype(uint64_t, v)) then
    -- tostring gives e.g. "123LL" / "123ULL": the digits are exact.
    out[#out + 1] = (tostring(v):gsub("U?LL$", ""))
  else
    error("json.encode: cannot encode a " .. tv .. " at " .. path_of(keys, depth), 0)
  end
end

--- json.encode(value, opts) -> string. opts.indent: a string (e.g. "  ")
-- to pretty-print with.
function M.encode(v, opts)
  local out = {}
  encode_value(v, out, opts and opts.indent, 0, {}, {})
  return concat(out)
end

-- ---- decoding ----

-- "position 17 (line 2, column 5)": 1-based byte offset, for humans.
local function where(s, pos)
  local line, col = 1, pos
  local i = 1
  while true do
    local j = find(s, "\n", i, true)
    if not j or j >= pos then break end
    line = line + 1
    col = pos - j
    i = j + 1
  end
  return fmt("position %d (line %d, column %d)", pos, line, col)
end

local function fail(s, pos, what)
  error("json.decode: " .. what .. " at " .. where(s, pos), 0)
end

local function skip_ws(s, pos)
  local _, e = find(s, "^[ \t\r\n]*", pos)
  return e + 1
end

local function utf8_char(cp)
  if cp < 0x80 then return char(cp) end
  if cp < 0x800 then return char(0xC0 + floor(cp / 64), 0x80 + cp % 64) end
  if cp < 0x10000 then
    return char(0xE0 + floor(cp / 4096), 0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
  end
  return char(0xF0 + floor(cp / 262144), 0x80 + floor(cp / 4096) % 64,
              0x80 + floor(cp / 64) % 64, 0x80 + cp % 64)
end

local unescape = {
  [byte '"'] = '"', [byte '\\'] = '\\', [byte '/'] = '/', [byte 'b'] = '\b',
  [byte 'f'] = '\f', [byte 'n'] = '\n', [byte 'r'] = '\r', [byte 't'] = '\t',
}

local function hex4(s, pos)
  local h = sub(s, pos, pos + 3)
  if not h:find("^%x%x%x%x$") then fail(s, pos, "bad \\u escape (expected 4 hex digits)") end
  return tonumber(h, 16)
end

-- pos is just after the opening quote; returns the string and the position
-- after the closing quote.
local function decode_string(s, pos)
  local parts = {}
  local start = pos
  while true do
    local i = find(s, '["\\%c]', pos)
    if not i then fail(s, start - 1, "unterminated string") end
    local c = byte(s, i)
    if c == 34 then            -- "
      parts[#parts + 1] = sub(s, pos, i - 1)
      return concat(parts), i + 1
    elseif c == 92 then        -- backslash
      parts[#parts + 1] = sub(s, pos, i - 1)
      local e = byte(s, i + 1)
      if e == 117 then         -- \uXXXX, maybe a surrogate pair
        local cp = hex4(s, i + 2)
        pos = i + 6
        if cp >= 0xD800 and cp <= 0xDBFF then
          if sub(s, pos, pos + 1) ~= "\\u" then fail(s, i, "lone high surrogate in \\u escape") end
          local lo = hex4(s, pos + 2)
          if lo < 0xDC00 or lo > 0xDFFF then fail(s, pos, "bad low surrogate in \\u escape") end
          cp = 0x10000 + (cp - 0xD800) * 1024 + (lo - 0xDC00)
          pos = pos + 6
        elseif cp >= 0xDC00 and cp <= 0xDFFF then
          fail(s, i, "lone low surrogate in \\u escape")
        end
        parts[#parts + 1] = utf8_char(cp)
      else
        local u = e and unescape[e]
        if not u then fail(s, i, "bad escape \\" .. (e and char(e) or "")) end
        parts[#parts + 1] = u
        pos = i + 2
      end
    elseif c == 127 then       -- DEL is %c in Lua but allowed raw in JSON
      parts[#parts + 1] = sub(s, pos, i)
      pos = i + 1
    else
      fail(s, i, fmt("control character 0x%02x in string (must be escaped)", c))
    end
  end
end

-- Strict JSON numbers: -?(0|[1-9]digits)(.digits)?([eE][+-]?digits)?
local function decode_number(s, pos)
  local _, e = find(s, "^-?%d+", pos)
  if not e then fail(s, pos, "malformed number") end
  if find(s, "^-?0%d", pos) then fail(s, pos, "malformed number (leading zero)") end
  local _, f = find(s, "^%.%d+", e + 1)
  if f then e = f elseif byte(s, e + 1) == 46 then fail(s, e + 1, "malformed number (digits expected after '.')") end
  local ex
  _, ex = find(s, "^[eE][-+]?%d+", e + 1)
  if ex then e = ex elseif find(s, "^[eE]", e + 1) then fail(s, e + 1, "malformed number (bad exponent)") end
  return tonumber(sub(s, pos, e)), e + 1
end

local decode_value

local function decode_array(s, pos, depth)
  local t = setmetatable({}, array_mt)
  pos = skip_ws(s, pos)
  if byte(s, pos) == 93 then return t, pos + 1 end   -- ]
  local n = 0
  while true do
    local v
    v, pos = decode_value(s, pos, depth)
    n = n + 1
    t[n] = v
    pos = skip_ws(s, pos)
    local c = byte(s, pos)
    if c == 93 then return t, pos + 1 end
    if c ~= 44 then fail(s, pos, c and "expected ',' or ']' in array" or "unterminated array") end
    pos = pos + 1
  end
end

local function decode_object(s, pos, depth)
  local t = {}
  pos = skip_ws(s, pos)
  if byte(s, pos) == 125 then return t, pos + 1 end  -- }
  while true do
    pos = skip_ws(s, pos)
    if byte(s, pos) ~= 34 then
      fail(s, pos, byte(s, pos) and "expected a string key in object" or "unterminated object")
    end
    local k
    k, pos = decode_string(s, pos + 1)
    pos = skip_ws(s, pos)
    if byte(s, pos) ~= 58 then fail(s, pos, "expected ':' after object key") end
    local v
    v, pos = decode_value(s, pos + 1, depth)
    if t[k] ~= nil then fail(s, pos, "duplicate key " .. encode_string(k)) end
    t[k] = v
    pos = skip_ws(s, pos)
    local c = byte(s, pos)
    if c == 125 then return t, pos + 1 end
    if c ~= 44 then fail(s, pos, c and "expected ',' or '}' in object" or "unterminated object") end
    pos = pos + 1
  end
end

decode_value = function(s, pos, depth)
  pos = skip_ws(s, pos)
  local c = byte(s, pos)
  if c == 123 then
    if depth >= MAX_DEPTH then fail(s, pos, "nested deeper than " .. MAX_DEPTH) end
    return decode_object(s, pos + 1, depth + 1)
  elseif c == 91 then
    if depth >= MAX_DEPTH then fail(s, pos, "nested deeper than " .. MAX_DEPTH) end
    return decode_array(s, pos + 1, depth + 1)
  elseif c == 34 then
    return decode_string(s, pos + 1)
  elseif c == 45 or (c and c >= 48 and c <= 57) then
    return decode_number(s, pos)
  elseif c == 116 and sub(s, pos, pos + 3) == "true" then
    return true, pos + 4
  elseif c == 102 and sub(s, pos, pos + 4) == "false" then
    return false, pos + 5
  elseif c == 110 and sub(s, pos, pos + 3) == "null" then
    return M.null, pos + 4
  elseif not c then
    fail(s, pos, "unexpected end of input")
  end
  fail(s, pos, fmt("unexpected character '%s'", char(c)))
end

--- json.decode(s) -> value. Errors name the position ("json.decode: ...
-- at position P (line L, column C)").
function M.decode(s)
  if type(s) ~= "string" then error("json.decode: expected a string, got " .. type(s), 0) end
  local v, pos = decode_value(s, 1, 0)
  pos = skip_ws(s, pos)
  if pos <= #s then fail(s, pos, "trailing characters after the JSON value") end
  return v
end

return M
