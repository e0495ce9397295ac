-- The LM head and its loss, and the embedding, by vocabulary chunks
-- (engine/ops/classifier.c): the (N, V) logits never exist, and a table
-- that fsdp.shard made a sliced unit is gathered, and its gradient
-- reduce-scattered, one chunk of rows at a time.
--
--   loss = fsdp.chunked_cross_entropy(x (N, C), weight (V, C), targets (N), { chunk = 8192,
--            ignore_index = -100, valid_vocab = 0 })    -- = cross_entropy(x @ weight^T)
--   x = fsdp.chunked_embedding(weight, ids, { chunk = 8192 })   -- = fsdp.embedding(weight, ids)
--   logits = fsdp.chunked_logits(x, weight, { chunk = 8192 })   -- (N, V), without gradients
--   loss = fsdp.classifier_cross_entropy(x, weight, targets, { ignore_index = -100, valid_vocab = 0 })
--            -- the whole vocabulary at once, the logits kept inside (dlogits written over them)
local core = require "fsdp.core"
local options = require "fsdp.options"

local C = core.C
local raise, wrap, T, out = core.raise, core.wrap, core.T, core.out

local M = {}

--- The chunk size (rows of the table per chunk): a positive integer.
function M.check_chunk(chunk, what, level)
  if type(chunk) ~= "number" or chunk < 1 or chunk ~= math.floor(chunk) or chunk ~= chunk or chunk == math.huge then
    error(string.format("%s: chunk must be a positive whole number of vocabulary rows, got %s (%s)", what,
      tostring(chunk), type(chunk)), (level or 2) + 1)
  end
  return chunk
end

local function opts_of(opts, names, what)
  if opts == nil then error(what .. ": options { chunk = rows } are required", 3) end
  if type(opts) ~= "table" then error(what .. ": options must be a table, got " .. type(opts), 3) end
  options.check_keys(opts, names, what, 3)
  return opts
end

function M.chunked_cross_entropy(x, weight, targets, opts)
  local what = "fsdp.chunked_cross_entropy"
  opts = opts_of(opts, { "chunk", "ignore_index", "valid_vocab" }, what)
  local chunk = M.check_chunk(opts.chunk, what, 2)
  if C.fsdp_chunked_cross_entropy(out, T(x, what), T(weight, what .. " weight"), T(targets, what .. " targets"),
        chunk, opts.ignore_index or -100, opts.valid_vocab or 0) ~= 0 then
    raise()
  end
  return wrap()
end

--- fsdp.classifier_cross_entropy(x (N, C), weight (V, C), targets (N), {ignore_index=-100, valid_vocab=0})
-- = cross_entropy(x @ weight^T) over the whole vocabulary in one op (llm.c's
-- fused classifier): the logits stay inside, and with gradients recorded
-- their memory holds dlogits, written in the same pass as the loss.
function M.classifier_cross_entropy(x, weight, targets, opts)
  local what = "fsdp.classifier_cross_entropy"
  opts = opts or {}
  if type(opts) ~= "table" then error(what .. ": options must be a table, got " .. type(opts), 2) end
  options.check_keys(opts, { "ignore_index", "valid_vocab" }, what, 2)
  if C.fsdp_classifier_cross_entropy(out, T(x, what), T(weight, what .. " weight"), T(targets, what .. " targets"),
        opts.ignore_index or -100, opts.valid_vocab or 0) ~= 0 then
    raise()
  end
  return wrap()
end

function M.chunked_embedding(weight, ids, opts)
  local what = "fsdp.chunked_embedding"
  opts = opts_of(opts, { "chunk" }, what)
  local chunk = M.check_chunk(opts.chunk, what, 2)
  if C.fsdp_chunked_embedding(out, T(weight, what), T(ids, what .. " ids"), chunk) ~= 0 then raise() end
  return wrap()
end

function M.chunked_logits(x, weight, opts)
  local what = "fsdp.chunked_logits"
  opts = opts_of(opts, { "chunk" }, what)
  local chunk = M.check_chunk(opts.chunk, what, 2)
  if C.fsdp_chunked_logits(out, T(x, what), T(weight, what .. " weight"), chunk) ~= 0 then raise() end
  return wrap()
end

return M
