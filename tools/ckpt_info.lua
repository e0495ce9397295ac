-- ckpt_info.lua: prints a sharded checkpoint's index (parameters, shapes,
-- step, world size, optimizer, files and their sizes) without loading any
-- tensor. A folder of step_NNNNNNNN checkpoints shows its newest one.
--   fsdp-lua tools/ckpt_info.lua checkpoints/step_00000100
--   fsdp-lua tools/ckpt_info.lua checkpoints            # the newest under it
local ck = require "fsdp.checkpoint"

local args = ... or {}
local dir = args[1]
if not dir or args.help then
  io.stderr:write("usage: fsdp-lua tools/ckpt_info.lua DIR   (a checkpoint, or a folder of step_* checkpoints)\n")
  os.exit(dir and 0 or 2)
end
local f = io.open(dir .. "/index.json", "rb")
if f then
  f:close()
else
  local latest = ck.latest(dir)
  if latest then
    print(string.format("(%s holds checkpoints; showing the newest)", dir))
    dir = latest
  end
end
local ok, text = pcall(ck.describe, dir)
if not ok then
  io.stderr:write("ckpt_info: ", tostring(text), "\n")
  os.exit(1)
end
print(text)
