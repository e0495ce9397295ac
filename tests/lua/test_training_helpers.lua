-- Tests for the library pieces a training recipe is made of: data.open and
-- data.splits (which files, which part, usage errors for paths), the
-- checkpoint manager (where to resume from, saving on a schedule, a resumed
-- step equal to the uninterrupted one), evaluate.loss, metrics summary and
-- tokenizer.printable.

package.path = (arg and arg[0] and arg[0]:match("^(.*/)") or "./") .. "?.lua;" .. package.path
local t = require "testlib"
local fsdp = require "fsdp"
local nn = require "fsdp.nn"
local optim = require "fsdp.optim"
local data = require "fsdp.data"
local fio = require "fsdp.io"
local json = require "fsdp.json"
local options = require "fsdp.options"
local ck = require "fsdp.checkpoint"
local evaluate = require "fsdp.evaluate"
local metrics = require "fsdp.metrics"
local tokenizer = require "fsdp.tokenizer"

local tmp = os.tmpname()
os.remove(tmp)
fio.mkdirs(tmp)
local function P(name) return tmp .. "/" .. name end

local function write(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  return path
end

-- fn must raise a usage error (one line, exit 2 on the command line) containing every needle.
local function usage_error(fn, needles, name)
  local ok, err = pcall(fn)
  t.ok(not ok and options.is_usage_error(err), name .. ": a usage error")
  t.raises(fn, needles, name)
end

-- A text of n printable bytes.
local function text_of(n)
  local b = {}
  for i = 1, n do b[i] = string.char(32 + (i * 7) % 251 % 95) end
  return table.concat(b)
end

-- A shard of n tokens starting at first.
local function shard(path, n, first)
  local toks = {}
  for i = 1, n do toks[i] = (first + i) % 256 end
  data.write_shard(path, toks)
  return path
end

-- ======================= data.open / data.splits =======================

do
  local text = text_of(1000)
  local path = write(P("corpus.txt"), text)
  local train, val = data.splits { data = path, batch = 2, ctx = 8, seed = 3, shuffle = false }
  t.eq(train.n_tokens, 900, "text: training reads the first nine tenths")
  t.eq(val.n_tokens, 100, "text: evaluation reads the last tenth")
  t.eq(data.decode_bytes((train:next())), text:sub(1, 16), "text: training starts at the first byte")
  t.eq(data.decode_bytes((val:next())), text:sub(901, 916), "text: evaluation starts after training's part")
  t.eq(train.seed, 3, "text: training's order from seed")
  t.eq(val.seed, 4, "text: the held-out split's order from seed + 1")
  t.eq(train.world, fsdp.world(), "world defaults to the job's")
  t.eq(train.rank, fsdp.rank(), "rank defaults to this process's")
  local sh = data.splits { data = path, batch = 2, ctx = 8, seed = 3 }
  t.eq(sh.shuffle, true, "splits shuffle by default")

  -- --val-data: training reads all of --data, evaluation all of the other file
  local other = write(P("other.txt"), text_of(500))
  train, val = data.splits { data = path, val_data = other, batch = 2, ctx = 8, seed = 3, shuffle = false }
  t.eq(train.n_tokens, 1000, "val_data: training reads all of data")
  t.eq(val.n_tokens, 500, "val_data: evaluation reads all of val_data")
  t.eq(val.seed, 3, "val_data: evaluation's order from seed, as before")

  -- this rank's rows of the global batch
  local r = data.open(path, "train", { batch = 4, ctx = 8, rank = 1, world = 2 })
  local x = r:next()
  t.eq(x:shape()[1], 2, "rank 1 of 2 takes 2 of 4 rows")
  t.eq(data.decode_bytes(x), text:sub(17, 32), "rank 1 of 2: the second half of the window")

  usage_error(function() data.splits { data = P("none.txt"), batch = 2, ctx = 8, what = "job.lua" } end,
    { "job.lua: '" .. P("none.txt") .. "': No such file" }, "a missing text file")
  usage_error(function() data.splits { data = path, val_data = P("none.txt"), batch = 2, ctx = 8, what = "job.lua" } end,
    { "job.lua: '" .. P("none.txt") .. "'" }, "a missing val_data")
  fio.mkdirs(P("adir.txt"))
  usage_error(function() data.open(P("adir.txt"), "train", { batch = 2, ctx = 8 }) end,
    { "data.open: no token shards (train_*.bin) in the folder" }, "a folder without shards")
  t.raises(function() data.open(path, "test", { batch = 2, ctx = 8 }) end, { "split", "'test'" }, "a bad split")
end

do   -- folders: train_* and val_* shards
  local dir = P("shards")
  fio.mkdirs(dir)
  shard(dir .. "/train_000.bin", 300, 0)
  shard(dir .. "/train_001.bin", 400, 1)
  shard(dir .. "/val_000.bin", 200, 2)
  local train, val = data.splits { data = dir .. "/", batch = 2, ctx = 8 }
  t.eq(#train.files, 2, "folder: training reads the train_ shards")
  t.eq(train.files[2], dir .. "/train_001.bin", "folder: the train_ shards in order")
  t.eq(#val.files, 1, "folder: evaluation reads the val_ shards")
  t.eq(val.files[1], dir .. "/val_000.bin", "folder: the val_ shard")
  t.eq(train.n_tokens, 700, "folder: training's tokens")
  -- with val_data the folder's every shard trains
  train = data.splits { data = dir, val_data = dir .. "/val_000.bin", batch = 2, ctx = 8 }
  t.eq(#train.files, 3, "folder with val_data: every shard trains")
  local empty = P("empty")
  fio.mkdirs(empty)
  usage_error(function() data.splits { data = empty, batch = 2, ctx = 8, what = "job.lua" } end,
    { "job.lua: no token shards (train_*.bin) in the folder " .. empty }, "a folder without train shards")
end

do   -- globs: the last shard is held out
  for i = 0, 2 do shard(P(string.format("g_%03d.bin", i)), 100 + 50 * i, i) end
  local train, val = data.splits { data = P("g_*.bin"), batch = 2, ctx = 8 }
  t.eq(#train.files, 2, "glob: all but the last shard train")
  t.eq(val.files[1], P("g_002.bin"), "glob: the last shard is held out")
  t.eq(val.n_tokens, 200, "glob: the held-out shard's tokens")
  train, val = data.splits { data = P("g_001.bin"), batch = 2, ctx = 8 }
  t.eq(train.files[1], P("g_001.bin"), "one shard: it trains")
  t.eq(val.files[1], P("g_001.bin"), "one shard: and evaluates")
  usage_error(function() data.splits { data = P("nothing_*.bin"), batch = 2, ctx = 8, what = "job.lua" } end,
    { "job.lua: no token shards match '" .. P("nothing_*.bin") .. "'" }, "a glob that matches nothing")
  write(P("bad_000.bin"), string.rep("x", 2048))
  local ok, err = pcall(data.splits, { data = P("bad_*.bin"), batch = 2, ctx = 8 })
  t.ok(not ok and not options.is_usage_error(err) and tostring(err):find("bad magic", 1, true) ~= nil,
    "a damaged shard: the loader's own error, naming it: " .. tostring(err))
end

-- ======================= tokenizer.printable =======================

do
  local s, decoded = tokenizer.printable({ 72, 105, 10, 33, 9, 300 }, 256)
  t.eq(s, "Hi ! ?", "bytes: control characters as spaces, ids past 255 as '?'")
  t.eq(decoded, true, "bytes: decoded")
  s, decoded = tokenizer.printable({ 15496, 995, 198, 0 }, 50257)
  t.eq(s, "Hello world !", "GPT-2's vocabulary: decoded by its tokenizer, newline as a space")
  t.eq(decoded, true, "GPT-2's vocabulary: decoded")
  s, decoded = tokenizer.printable({ 15496, 50300 }, 50257)
  t.eq(s, "15496 50300", "an id outside GPT-2's vocabulary: the ids")
  t.eq(decoded, false, "an id outside GPT-2's vocabulary: not decoded")
  s, decoded = tokenizer.printable({ 1, 2, 3 }, 1000)
  t.eq(s, "1 2 3", "a vocabulary without a decoder: the ids")
  t.eq(decoded, false, "a vocabulary without a decoder: not decoded")
  t.raises(function() tokenizer.printable("abc", 256) end, { "tokenizer.printable", "string" }, "ids not a list")
end

-- ======================= metrics summary =======================

do
  local m = metrics.new { peak_flops = 1e12 }
  local s = m:summary()
  t.ok(s.steps == 0 and s.mean_step_ms == 0 and s.peak_bytes == 0, "summary before any step: zeros")
  local sum, peak = 0, 0
  for i = 1, 3 do
    m:begin_step()
    local a = fsdp.randn(64 * i, 64, { seed = i })
    local b = a:matmul(a:t())
    b:free(); a:free()
    local rec = m:end_step { step = i }
    sum, peak = sum + rec.step_ms, math.max(peak, rec.peak_bytes.total)
  end
  s = m:summary()
  t.eq(s.steps, 3, "summary: steps recorded")
  t.near(s.mean_step_ms, sum / 3, 1e-12, "summary: mean of the steps' times")
  t.eq(s.peak_bytes, peak, "summary: the largest step peak")
  t.ok(peak >= (64 * 3 * 64 + (64 * 3) ^ 2) * 4, "summary: the peak holds the last step's tensors")
  m:close()
end

-- a resumed run (steps 21..25 of 30): the summary counts its 5 steps, and its
-- mean leaves out the first 2 (warm-up)
do
  local m = metrics.new { peak_flops = 1e12, warmup_steps = 2, total_steps = 30, tokens_per_step = 100,
    flops_per_token = 1e6 }
  local times = {}
  for i = 21, 25 do
    m:begin_step()
    local a = fsdp.randn(32 * (i - 19), 64, { seed = i })
    a:matmul(a:t()):free(); a:free()
    times[#times + 1] = m:end_step { step = i }.step_ms
  end
  local s = m:summary()
  t.eq(s.steps, 5, "resumed: the steps this run did")
  t.eq(s.first_step, 21, "resumed: its first step")
  t.eq(s.last_step, 25, "resumed: its last step")
  t.eq(s.warmup_steps, 2, "resumed: warm-up steps left out")
  t.eq(s.timed_steps, 3, "resumed: steps in the mean")
  t.near(s.mean_step_ms, (times[3] + times[4] + times[5]) / 3, 1e-12, "resumed: the mean after warm-up")
  t.near(s.mfu, 100 * 100 / (s.mean_step_ms / 1e3) * 1e6 / 1e12, 1e-9, "summary MFU: a percentage of the peak")
  m:close()
  t.eq(metrics.median { 5, 1, 3 }, 3, "median, odd")
  t.eq(metrics.median { 4, 1, 3, 10 }, 3.5, "median, even")
  t.eq(metrics.duration(42.4), "42s", "duration: seconds")
  t.eq(metrics.duration(725), "12m05s", "duration: minutes")
  t.eq(metrics.duration(3 * 3600 + 7 * 60), "3h07m", "duration: hours")
end

-- ======================= a sharded run: evaluate, checkpoint manager =======================

local cfg = { vocab_size = 256, n_layer = 2, n_head = 3, n_embd = 12, block_size = 9, dropout = 0.1 }
local corpus = write(P("run.txt"), text_of(3000))

local function setup(seed)
  local model = nn.GPT(cfg)
  local sharded = fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = seed })
  local opt = optim.AdamW(sharded:param_groups(0.1), { lr = 1e-2 })
  local train, val = data.splits { data = corpus, batch = 4, ctx = cfg.block_size, seed = 1 }
  return model, sharded, opt, train, val
end

local function train_step(model, opt, train)
  local x, y = train:next()
  local _, loss = model(x, y)
  loss:backward()
  opt:step()
  opt:zero_grad()
  return loss:item()
end

do   -- evaluate.loss: eval mode (no dropout), no gradients, the mean over batches
  local model, _, _, _, val = setup(7)
  local ref_loader = select(2, data.splits { data = corpus, batch = 4, ctx = cfg.block_size, seed = 1 })
  model:eval()
  local ref = 0
  fsdp.no_grad(function()
    for _ = 1, 3 do
      local x, y = ref_loader:next()
      local _, l = model(x, y)
      ref = ref + l:item()
    end
  end)
  model:train()
  local got = evaluate.loss(model, val, 3)
  t.near(got, ref / 3, 1e-12, "evaluate.loss: the mean of eval-mode losses")
  t.eq(val:state().index, 3, "evaluate.loss: reads n batches")
  t.eq(model.training, true, "evaluate.loss: back in train mode")
  model:eval()
  evaluate.loss(model, val, 1)
  t.eq(model.training, false, "evaluate.loss: a model in eval mode stays so")
  t.raises(function() evaluate.loss(model, val, 0) end, { "evaluate.loss", "positive integer" }, "n = 0")
end

do   -- evaluate.loss asks for the loss alone (the fused head): the loss of the head with logits, bit for bit
  for _, bf16 in ipairs({ false, true }) do
    local model = nn.GPT(cfg)
    fsdp.shard(model, { seed = 9, mixed_precision = bf16 and { compute = "bf16" } or nil })
    local asked, forward = {}, model.forward
    model.forward = function(self, x, y, opts)
      asked[#asked + 1] = opts and opts.logits
      return forward(self, x, y, opts)
    end
    local _, val = data.splits { data = corpus, batch = 4, ctx = cfg.block_size, seed = 2 }
    local _, ref_loader = data.splits { data = corpus, batch = 4, ctx = cfg.block_size, seed = 2 }
    local got = evaluate.loss(model, val, 2)
    model.forward = forward   -- (fsdp.shard's own, put back)
    model:eval()
    local ref = 0
    fsdp.no_grad(function()
      for _ = 1, 2 do
        local x, y = ref_loader:next()
        local logits, l = model(x, y)
        t.ok(logits ~= nil, "the reference keeps its logits")
        ref = ref + l:item()
      end
    end)
    local dt = bf16 and "bf16" or "f32"
    t.eq(#asked == 2 and asked[1] == false and asked[2] == false, true, dt .. ": evaluate.loss calls model(x, y, "
      .. "{ logits = false })")
    t.eq(got, ref / 2, dt .. ": evaluate.loss with the fused head: the loss with logits, bit for bit")
  end
end

do   -- evaluate.loss with head_chunk: the model gives nil, loss; the loss is freed by hand too
  local function run(chunk)
    local c = {}
    for k, v in pairs(cfg) do c[k] = v end
    c.head_chunk = chunk
    local model = nn.GPT(c)
    fsdp.shard(model, { policy = fsdp.policy.per_block(), seed = 5 })
    local _, val = data.splits { data = corpus, batch = 4, ctx = cfg.block_size, seed = 1 }
    evaluate.loss(model, val, 1)   -- the first forward caches the position ids
    fsdp.collect()
    collectgarbage("stop")   -- only the explicit frees may give memory back
    local before = fsdp.memory.stats("activation").current
    local total_before = fsdp.memory.stats().current
    local l = evaluate.loss(model, val, 2)   -- batches 2 and 3
    local left = fsdp.memory.stats("activation").current - before
    local total_left = fsdp.memory.stats().current - total_before
    collectgarbage("restart")
    return l, left, total_left
  end
  local ref = run(nil)
  local got, left, total_left = run(37)   -- 37 rows: an odd chunk, the vocabulary not a multiple of it
  t.near(got, ref, 1e-5, "evaluate.loss with head_chunk: the loss without it")
  t.eq(left, 0, "evaluate.loss with head_chunk: no activation bytes left behind")
  t.eq(total_left, 0, "evaluate.loss with head_chunk: no bytes left behind")
end

do   -- the checkpoint manager
  local logs = {}
  local function log(f, ...) logs[#logs + 1] = string.format(f, ...) end
  local save_dir = P("ckpt")
  usage_error(function() ck.manager { save_dir = save_dir, resume = P("nowhere"), what = "job.lua" } end,
    { "job.lua: --resume=" .. P("nowhere") .. ": no checkpoint there" }, "resume from a path without a checkpoint")
  t.raises(function() ck.manager { save_dir = "" } end, { "save_dir" }, "an empty save_dir")
  t.raises(function() ck.manager { save_dir = save_dir, save_every = -1 } end, { "save_every" }, "save_every < 0")
  t.raises(function() ck.manager { save_dir = save_dir, keep = 1.5 } end, { "keep" }, "keep not an integer")
  local fresh = ck.manager { save_dir = save_dir, save_every = 2, resume = true, log = log }
  t.eq(fresh.dir, nil, "resume = true, nothing saved yet: a fresh start")
  t.raises(function() fresh:maybe_save(2) end, { "maybe_save before load" }, "maybe_save before load")

  -- run A: 5 steps, a checkpoint every 2 (the newest 1 kept), an evaluation batch before each save
  local model, sharded, opt, train, val = setup(11)
  local run = ck.manager { save_dir = save_dir, save_every = 2, keep = 1, resume = true, log = log }
  t.eq(run:load { model = sharded, optim = opt, data = train, val = val, schedule = { kind = "cosine", lr = 1e-2 },
    extra = { preset = "odd" } }, 1, "a fresh start begins at step 1")
  t.eq(logs[1], "--resume: no checkpoint under " .. save_dir .. " yet; starting at step 1", "the fresh start is said")
  local losses, saved = {}, {}
  for step = 1, 5 do
    losses[step] = train_step(model, opt, train)
    if step % 2 == 0 then evaluate.loss(model, val, 1) end
    saved[step] = run:maybe_save(step)
  end
  t.ok(not saved[1] and saved[2] and not saved[3] and saved[4] and not saved[5], "saved every 2 steps")
  t.eq(saved[4], save_dir .. "/step_00000004", "the folder of step 4")
  t.eq(logs[#logs], "step     4 | saved " .. save_dir .. "/step_00000004", "the save is said")
  t.eq(fio.is_dir(save_dir .. "/step_00000002"), false, "keep = 1: the older checkpoint is gone")
  local index = json.decode(fio.read_file(saved[4] .. "/index.json"))
  t.eq(index.schedule.step, 4, "the schedule is saved with its step")
  t.eq(index.schedule.kind, "cosine", "the schedule's fields are saved")
  t.eq(index.extra.preset, "odd", "extra is saved")
  t.eq(index.extra.val.index, 2, "the evaluation loader's position is saved")
  t.eq(index.data.index, 4, "the training loader's position is saved")

  -- run B: another init, resumed from the newest: step 5 is run A's step 5, bit for bit (dropout on)
  local model2, sharded2, opt2, train2, val2 = setup(99)
  local run2 = ck.manager { save_dir = save_dir, save_every = 2, resume = true, log = log }
  t.eq(run2.dir, saved[4], "resume = true: the newest checkpoint")
  t.eq(run2:load { model = sharded2, optim = opt2, data = train2, val = val2 }, 5, "resumed: the next step is 5")
  t.ok(logs[#logs]:find("resumed from " .. saved[4] .. " (saved by 1 rank(s)): step 4, next data window 4 of epoch 0",
    1, true) ~= nil, "the resume is said: " .. logs[#logs])
  t.eq(val2:state().index, 2, "the evaluation loader goes on where it was")
  t.eq(train_step(model2, opt2, train2), losses[5], "the resumed step equals the uninterrupted one")
  local by_path = ck.manager { save_dir = P("elsewhere"), resume = saved[4] }
  t.eq(by_path.dir, saved[4], "resume = PATH of a checkpoint: that one")
  local under = ck.manager { save_dir = P("elsewhere"), resume = save_dir }
  t.eq(under.dir, saved[4], "resume = PATH of a folder: the newest in it")
  local never = ck.manager { save_dir = save_dir, log = log }
  t.eq(never:load { model = sharded2, optim = opt2, data = train2 }, 1, "no resume: step 1")
  t.eq(never:maybe_save(4), nil, "save_every = 0: never saves")

  -- a checkpoint saved without the loader's position (or a step): a clear error naming it
  ck.save(P("bare/step_00000003"), { model = sharded, optim = opt, step = 3 })
  local bare_dir = P("bare/step_00000003")
  local pos_before = train2:state().index
  local run3 = ck.manager { save_dir = P("bare"), resume = true, log = log, what = "job.lua" }
  t.eq(run3.dir, bare_dir, "resume = true: the bare checkpoint is found")
  t.raises(function() run3:load { model = sharded2, optim = opt2, data = train2 } end,
    { "job.lua: cannot resume from " .. bare_dir, "no data-loader position", "data = loader:state()" },
    "resume from a checkpoint without the loader's position")
  ck.save(P("nostep/step_00000003"), { model = sharded, optim = opt, data = train:state() })
  local run4 = ck.manager { save_dir = P("nostep"), resume = true, log = log }
  t.raises(function() run4:load { model = sharded2, optim = opt2, data = train2 } end,
    { "cannot resume from " .. P("nostep/step_00000003"), "has no step" }, "resume from a checkpoint without a step")
  t.eq(train2:state().index, pos_before, "the refused resume leaves the loader where it was")
end

fio.remove_tree(tmp)
t.done()
