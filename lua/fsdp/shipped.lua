-- fsdp.shipped: the files that come with fsdp-lua (the bundled text, the
-- tokenizer, the recipes, the user tools), found beside its Lua library:
-- the repository root in a source tree, <prefix>/share/fsdp-lua once
-- installed. So a recipe's defaults work from any directory.
--   fsdp.shipped("data/corpus.txt")   -- "data/corpus.txt" from the root, else a full path
local M = {}

--- fsdp.shipped_root(): the folder holding lua/, data/, recipes/ and tools/.
function M.root()
  local here = package.searchpath("fsdp.shipped", package.path)
  local lib = here and here:match("^(.*)/fsdp/shipped%.lua$")
  return lib and (lib:match("^(.*)/[^/]*$") or ".") or "."
end

--- fsdp.shipped(rel): the path of the shipped file rel; rel as it is when the
-- working directory is that folder (a short name in logs), else the full path.
function M.path(rel)
  local root = M.root()
  if root == "." or root == os.getenv("PWD") then return rel end
  return root .. "/" .. rel
end

return M
