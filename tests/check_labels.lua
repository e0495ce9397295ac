-- tests/check_labels.lua CTEST BUILD: every test of the build has one tier
-- label (fast or slow) and one subject label, and the fast tier holds at
-- least one test of every subject (tests/labels.cmake). The check runs on a
-- planted bad list first: it must find each fault there.
local json = require "fsdp.json"
local ctest, build = arg[1], arg[2]
assert(ctest and build, "usage: check_labels.lua CTEST BUILD")

local TIERS = { fast = true, slow = true }

-- problems(tests): the faults found, as lines; tests: { { name =, labels = {...} } }
local function problems(tests)
  local out, fast_of, subjects = {}, {}, {}
  for _, t in ipairs(tests) do
    local tiers, subject = {}, {}
    for _, l in ipairs(t.labels) do
      if TIERS[l] then tiers[#tiers + 1] = l else subject[#subject + 1] = l end
    end
    if #tiers ~= 1 then out[#out + 1] = t.name .. ": " .. #tiers .. " tier labels, expected 1 (fast or slow)" end
    if #subject ~= 1 then out[#out + 1] = t.name .. ": " .. #subject .. " subject labels, expected 1" end
    if #tiers == 1 and #subject == 1 then
      subjects[subject[1]] = true
      if tiers[1] == "fast" then fast_of[subject[1]] = (fast_of[subject[1]] or 0) + 1 end
    end
  end
  local names = {}
  for s in pairs(subjects) do names[#names + 1] = s end
  table.sort(names)
  for _, s in ipairs(names) do
    if not fast_of[s] then out[#out + 1] = "subject " .. s .. " has no test in the fast tier" end
  end
  return out, names, fast_of
end

-- the planted list: a test without a tier, one with two subjects, a subject with no fast test
local bad = {
  { name = "a", labels = { "fast", "kernels" } },
  { name = "b", labels = { "kernels" } },
  { name = "c", labels = { "slow", "planner", "kernels" } },
  { name = "d", labels = { "slow", "network" } },
}
local found = problems(bad)
local want = { "b: 0 tier labels", "c: 2 subject labels", "subject network has no test in the fast tier" }
local fails = 0
for _, w in ipairs(want) do
  local hit = false
  for _, f in ipairs(found) do hit = hit or f:find(w, 1, true) ~= nil end
  if not hit then
    print("FAIL: the check misses a planted fault: " .. w)
    fails = fails + 1
  end
end

local p = assert(io.popen(string.format("'%s' --test-dir '%s' --show-only=json-v1", ctest, build)))
local doc = json.decode(p:read("*a"))
p:close()
local tests = {}
for _, t in ipairs(doc.tests) do
  local labels = {}
  for _, prop in ipairs(t.properties or {}) do
    if prop.name == "LABELS" then labels = prop.value end
  end
  tests[#tests + 1] = { name = t.name, labels = labels }
end
local found_real, subjects, fast_of = problems(tests)
for _, f in ipairs(found_real) do print("FAIL: " .. f) end
fails = fails + #found_real
if #tests < 2 then
  print("FAIL: ctest listed " .. #tests .. " tests")
  fails = fails + 1
end
local per = {}
for _, s in ipairs(subjects) do per[#per + 1] = s .. " " .. (fast_of[s] or 0) end
print(string.format("%d tests; fast tests per subject: %s", #tests, table.concat(per, ", ")))
if fails > 0 then os.exit(1) end
print("labels ok")
