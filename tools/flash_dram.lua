-- flash_dram.lua: the DRAM bytes the cost model predicts for the flash
-- attention at one shape (causal, bf16, from a packed qkv), per table entry:
-- after the L2 rule (tools/gpu_model.lua) and counting every read. Run by
-- tools/gpu-check's flash-dram stage beside ncu's measurement of the same
-- kernels; by hand:
--   build/fsdp-lua tools/flash_dram.lua --batch=16 --heads=12 --ctx=1024 --head-dim=64
-- Prints one line per entry:
--   model <entry> read <bytes> written <bytes> every_read <bytes>
local fsdp = require "fsdp"
local meta = require "fsdp.meta"

local args = ... or {}
local B, H, T, D = tonumber(args.batch), tonumber(args.heads), tonumber(args.ctx), tonumber(args.head_dim)
if not (B and H and T and D) then
  io.stderr:write("flash_dram.lua: --batch=B --heads=H --ctx=T --head-dim=D, all required\n")
  os.exit(2)
end
local ok, err = pcall(meta.mimic, "cuda")
if not ok then
  io.stderr:write("flash_dram.lua: " .. tostring(err) .. "\n")
  os.exit(1)
end
local qkv = fsdp.randn(B, T, 3 * H * D, { seed = 1, device = "meta" }):cast("bf16"):requires_grad(true)
meta.reset()
fsdp.attention_qkv(qkv, H, { causal = true }):sum():backward()
local e = meta.by_name()
for _, name in ipairs({ "attention_flash_forward_bf16", "attention_flash_backward_bf16" }) do
  local c = e[name]
  if c.calls ~= 1 then
    io.stderr:write(string.format("flash_dram.lua: %s ran %d times at (%d, %d, %d, %d), not once: not the flash "
      .. "path at this shape\n", name, c.calls, B, H, T, D))
    os.exit(1)
  end
  io.stdout:write(string.format("model %s read %d written %d every_read %d\n", name, c.bytes_read - c.bytes_l2,
    c.bytes_written, c.bytes_read))
end
meta.mimic("cpu")
