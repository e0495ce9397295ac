-- tests/arch/check_layers.lua ROOT: the engine's parts (the folders of
-- engine/) and the includes between them. Each `#include "x"` of a file
-- is an edge from its part to the part holding x. engine/core has no edge
-- to another part (the public header, engine/include, is everyone's), and
-- the graph has no cycle. A planted cycle is checked first: it must be found.
local root = assert(arg[1], "usage: check_layers.lua ROOT")

local function parts_graph(files_of)   -- files_of[part] = { path = text }
  local home = {}   -- header name -> part
  for part, files in pairs(files_of) do
    for path in pairs(files) do home[path:match("([^/]+)$")] = part end
  end
  local edges = {}
  for part, files in pairs(files_of) do
    edges[part] = edges[part] or {}
    for path, text in pairs(files) do
      for inc in text:gmatch('#%s*include%s+"([^"]+)"') do
        local to = home[inc:match("([^/]+)$")]
        if to and to ~= part then edges[part][to] = edges[part][to] or path .. " includes " .. inc end
      end
    end
  end
  return edges
end

-- a cycle as a list of parts, or nil
local function find_cycle(edges)
  local state, stack = {}, {}
  local function visit(p)
    state[p] = "open"
    stack[#stack + 1] = p
    local tos = {}
    for to in pairs(edges[p] or {}) do tos[#tos + 1] = to end
    table.sort(tos)
    for _, to in ipairs(tos) do
      if state[to] == "open" then
        local cyc = {}
        for i = #stack, 1, -1 do
          table.insert(cyc, 1, stack[i])
          if stack[i] == to then break end
        end
        cyc[#cyc + 1] = to
        return cyc
      elseif not state[to] then
        local c = visit(to)
        if c then return c end
      end
    end
    stack[#stack] = nil
    state[p] = "done"
  end
  local parts = {}
  for p in pairs(edges) do parts[#parts + 1] = p end
  table.sort(parts)
  for _, p in ipairs(parts) do
    if not state[p] then
      local c = visit(p)
      if c then return c end
    end
  end
end

local fails = 0
local function fail(msg) print("FAIL: " .. msg); fails = fails + 1 end

-- the planted graph: a -> b -> c -> a
local planted = parts_graph {
  a = { ["a/a.c"] = '#include "b.h"' }, b = { ["b/b.h"] = '#include "c.h"' }, c = { ["c/c.h"] = '#include "a.c"' },
}
local pc = find_cycle(planted)
if not pc or #pc ~= 4 then fail("the check misses the planted cycle a -> b -> c -> a") end

-- the engine
local files_of = {}
local p = assert(io.popen("cd '" .. root .. "' && find engine -type f \\( -name '*.c' -o -name '*.h' -o -name '*.cu' "
  .. "-o -name '*.def' \\) | sort"))
for path in p:lines() do
  local part = path:match("^engine/([^/]+)/")
  if part and part ~= "include" then
    local f = assert(io.open(root .. "/" .. path, "rb"))
    files_of[part] = files_of[part] or {}
    files_of[part][path] = f:read("*a")
    f:close()
  end
end
p:close()
if not files_of.core then fail("no engine/core found under " .. root) end
local edges = parts_graph(files_of)
for to, why in pairs(edges.core or {}) do fail("engine/core reaches up into engine/" .. to .. ": " .. why) end
local cyc = find_cycle(edges)
if cyc then fail("the parts include each other in a cycle: " .. table.concat(cyc, " -> ")) end

local names = {}
for part in pairs(edges) do names[#names + 1] = part end
table.sort(names)
for _, part in ipairs(names) do
  local tos = {}
  for to in pairs(edges[part]) do tos[#tos + 1] = to end
  table.sort(tos)
  print(string.format("%-12s -> %s", part, #tos > 0 and table.concat(tos, ", ") or "(nothing)"))
end
if fails > 0 then os.exit(1) end
print("layers ok: " .. #names .. " parts, no cycle, core includes no other part")
