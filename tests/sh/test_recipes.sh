#!/usr/bin/env bash
# The GPT-2 recipe end to end, and its bad input: each mistake is a one-line
# error naming the value and what was expected, with a non-zero exit.
#   bash tests/sh/test_recipes.sh <launcher> <repo root>
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
export OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1

# fails NAME TEXT... -- ARGS: the recipe exits non-zero and prints every TEXT
fails() {
  local name=$1; shift
  local want=()
  while [ "$1" != "--" ]; do want+=("$1"); shift; done
  shift
  local out rc
  out=$("$L" recipes/gpt2.lua "$@" 2>&1); rc=$?
  if [ $rc -eq 0 ]; then bad "$name: exit code 0" "$out"; return; fi
  ok
  for w in "${want[@]}"; do has "$name" "$out" "$w"; done
}

# a short run trains: the last logged loss is below the first
out=$("$L" recipes/gpt2.lua --steps=40 --log-every=10 --eval-every=20 --sample=8 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "gpt2 tiny run exit $rc" "$out"
first=$(grep -E '^step +1/40 \|' <<<"$out" | sed -E 's/.*loss ([0-9.]+).*/\1/')
last=$(grep -E '^step +40/40 \|' <<<"$out" | sed -E 's/.*loss ([0-9.]+).*/\1/')
if awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 1.0) }'; then ok; else bad "loss falls ($first -> $last)" "$out"; fi
has "eval line" "$out" "eval loss"
has "sample line" "$out" "continuation |"

# the Llama variant and activation recomputation run too
out=$("$L" recipes/gpt2.lua --model=llama --recompute --steps=3 --eval-every=0 --sample=0 2>&1)
[ $? -eq 0 ] && ok || bad "llama + checkpoint run" "$out"

# options
fails "unknown option" "unknown option --stpes" "known:" -- --stpes=10
fails "wrong type" "--steps expects an integer, got 'ten'" -- --steps=ten
fails "not an integer" "--batch expects an integer, got '2.5'" -- --batch=2.5
fails "bad choice" "--preset expects one of tiny, small, got 'huge'" -- --preset=huge
fails "positional" "unexpected argument 'oops'" -- oops
# data
fails "missing data file" "$TMP/none.txt" -- --data="$TMP/none.txt"
printf 'garbage header, not a shard at all................................................' > "$TMP/bad_000.bin"
head -c 2048 /dev/zero >> "$TMP/bad_000.bin"
fails "bad shard header" "bad_000.bin" "20240520" -- --data="$TMP/bad_*.bin"
"$L" -e "local d = require 'fsdp.data'; d.write_shard('$TMP/short_000.bin', {1, 2, 3}, 3)" >/dev/null 2>&1
fails "too few tokens" "short_000.bin" -- --data="$TMP/short_*.bin"
# a shape of one's own over the preset: 3 blocks of width 48, 3 heads (V=256, T=64):
# wte 256*48 + wpe 64*48 + 3 x (12*48^2 + 13*48) + ln_f 2*48 = 100272 parameters
out=$("$L" recipes/gpt2.lua --layers=3 --width=48 --heads=3 --steps=2 --eval-every=0 --sample=0 2>&1)
[ $? -eq 0 ] && ok || bad "--layers --width --heads run" "$out"
has "the shape asked" "$out" "gpt tiny: 0.10M parameters, 3 layers, width 48"
# --vocab and --hidden: V=300 (padded 384), C=32, one block with an MLP of 40:
# wte 384*32 + wpe 64*32 + ln 2*64 + c_attn 32*96+96 + proj 32*32+32 + c_fc 32*40+40 + c_proj 40*32+32 + ln_f 64
out=$("$L" recipes/gpt2.lua --layers=1 --width=32 --heads=2 --hidden=40 --vocab=300 --steps=1 --eval-every=0 \
      --sample=0 2>&1)
has "--vocab" "$out" "1 layers, width 32, vocab 300 (padded 384)"
out=$("$L" -e 'print(require("fsdp.nn").GPT { vocab_size = 300, n_layer = 1, n_head = 2, n_embd = 32, block_size = 64,
  hidden = 40 }:num_parameters())' 2>&1)
[ "$out" = 21384 ] && ok || bad "GPT's hidden: 21384 parameters" "$out"
fails "width not divisible by heads" "the width 30 is not divisible by 4 heads (--width, --heads)" -- --width=30
fails "llama's odd head size" "the head size 9 (width 36 / 4 heads) must be even" -- --model=llama --width=36
fails "--init with a shape" "--init loads GPT-2's own shape" -- --init=tests/fixtures/gpt2_tiny_golden.safetensors --hidden=8
# context longer than the model's
fails "context too long" "--ctx=100 is longer than the tiny model's context of 64" -- --ctx=100
# token ids beyond the vocabulary: GPT-2-sized ids into the byte-level tiny model
"$L" -e "local d = require 'fsdp.data'; local t = {}; for i = 1, 4000 do t[i] = 300 + i % 1000 end; d.write_shard('$TMP/big_000.bin', t, #t)" >/dev/null 2>&1
fails "token id beyond the vocabulary" "big_000.bin' holds token id 301 at token 0, beyond the tiny model's vocabulary of 256" \
  "use --preset=small" -- --data="$TMP/big_*.bin" --steps=1
# empty and too short text: the one-line usage error (exit 2), no traceback
: > "$TMP/empty.txt"; printf 'hello' > "$TMP/short.txt"
for f in empty short; do
  out=$("$L" recipes/gpt2.lua --data="$TMP/$f.txt" --steps=1 2>&1); rc=$?
  [ $rc -eq 2 ] && [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] && grep -q "$f.txt (train)' has [0-9]* tokens, fewer than" <<<"$out" \
    && ok || bad "--data=$f.txt: one usage line (exit $rc)" "$out"
done
# a --save-dir that cannot be made: refused before the first step, not at the first save
out=$("$L" recipes/gpt2.lua --save-every=1 --save-dir="$TMP/short.txt/ck" --steps=2 2>&1); rc=$?
[ $rc -eq 2 ] && ! grep -q "step 1/" <<<"$out" && grep -q "save-dir=$TMP/short.txt/ck cannot be written on rank 0" <<<"$out" \
  && ok || bad "unwritable --save-dir refused at start (exit $rc)" "$out"
# one id past the vocabulary deep in the second shard (past any sample of the first tokens): found at open, named
"$L" -e "local d = require 'fsdp.data'; local t = {}; for i = 1, 1100000 do t[i] = i % 256 end
  d.write_shard('$TMP/deep_000.bin', t, #t); t[1048579] = 256; d.write_shard('$TMP/deep_001.bin', t, #t)" >/dev/null 2>&1
fails "a deep token id beyond the vocabulary" "deep_001.bin' holds token id 256 at token 1048578, beyond the tiny model's vocabulary of 256" \
  -- --data="$TMP/deep_*.bin" --steps=1
# a one-line message: the first line names the problem (no traceback needed to see it)
out=$("$L" recipes/gpt2.lua --steps=ten 2>&1 | head -1)
has "first line" "$out" "--steps expects an integer"

# usage errors: exactly one line, no traceback, exit status 2
one_line() {
  local name=$1 want=$2; shift 2
  local out rc
  out=$("$L" "$@" 2>&1); rc=$?
  if [ $rc -ne 2 ]; then bad "$name: exit $rc, want 2" "$out"; return; fi
  ok
  if [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ]; then ok; else bad "$name: more than one line" "$out"; fi
  has "$name" "$out" "$want"
}
one_line "did you mean" "unknown option --stpes (did you mean --steps?" recipes/gpt2.lua --stpes=10
one_line "did you mean a value" "got 'ful_shard' (did you mean 'full_shard'?)" recipes/gpt2.lua --strategy=ful_shard
one_line "steps >= 1" "--steps must be at least 1, got -5" recipes/gpt2.lua --steps=-5
one_line "steps = 0" "--steps must be at least 1, got 0" recipes/gpt2.lua --steps=0
one_line "batch >= 1" "--batch must be at least 1, got 0" recipes/gpt2.lua --batch=0
one_line "lr >= 0" "--lr must be at least 0, got -1" recipes/gpt2.lua --lr=-1
one_line "threads <= 256" "--threads must be at most 256, got 1000" recipes/gpt2.lua --threads=1000
one_line "data is a folder without shards" "no token shards" recipes/gpt2.lua --data="$TMP"
mkdir -p "$TMP/dir.txt"
one_line "val data missing" "--val-data=$TMP/none.txt: No such file" recipes/gpt2.lua --val-data="$TMP/none.txt"
one_line "init missing" "--init=$TMP/none.safetensors: No such file" recipes/gpt2.lua --init="$TMP/none.safetensors"
one_line "init is a directory" "--init=$TMP/dir.txt: Is a directory" recipes/gpt2.lua --init="$TMP/dir.txt"
if [ "$(id -u)" -ne 0 ]; then   # root reads every file
  printf 'x' > "$TMP/locked.safetensors"; chmod 000 "$TMP/locked.safetensors"
  one_line "init unreadable" "Permission denied" recipes/gpt2.lua --init="$TMP/locked.safetensors"
fi
one_line "export into a directory" "--export=$TMP/dir.txt: Is a directory" recipes/gpt2.lua --export="$TMP/dir.txt"
one_line "export under a missing folder" "--export=$TMP/no/such/out.safetensors: No such file" recipes/gpt2.lua \
  --export="$TMP/no/such/out.safetensors"
[ ! -e "$TMP/out.safetensors" ] && ok || bad "nothing written by the check"
"$L" recipes/gpt2.lua --export="$TMP/out.safetensors" --steps=1 --eval-every=0 --sample=0 --batch=2 >/dev/null 2>&1
[ -s "$TMP/out.safetensors" ] && ok || bad "--export writes the file after training"
one_line "llama cannot export HF names" "--export uses Hugging Face GPT-2 names, which --model=llama does not have" \
  recipes/gpt2.lua --model=llama --export="$TMP/llama.safetensors"
[ ! -e "$TMP/llama.safetensors" ] && ok || bad "the refused export wrote nothing"
one_line "group size without hybrid" "--group-size goes with --strategy=hybrid_shard" recipes/gpt2.lua --group-size=2
one_line "resume from nowhere" "--resume=$TMP/none: no checkpoint there" recipes/gpt2.lua --resume="$TMP/none"
one_line "mlp typo" "mlp.lua: unknown option --stesp (did you mean --steps?" recipes/mlp.lua --stesp=3
one_line "mlp range" "mlp.lua: --hidden must be at least 1, got 0" recipes/mlp.lua --hidden=0
out=$("$L" recipes/mlp.lua --help 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "mlp --help exits 0" "$out"
has "mlp --help" "$out" "--steps"
if grep -q "^step" <<<"$out"; then bad "mlp --help trains nothing" "$out"; else ok; fi

# evaluation reads held-out data: the last tenth of the text by default
out=$("$L" recipes/gpt2.lua --steps=1 --eval-every=1 --eval-steps=1 --batch=2 --sample=0 2>&1)
has "held-out split" "$out" "eval loss"
"$L" -e "
local data = require 'fsdp.data'
local a = data.ByteLoader{ path = 'data/corpus.txt', batch = 8, ctx = 64, split = 'val' }
assert(#a.text < 20000, 'the val split is a tenth of the corpus')" 2>&1 && ok || bad "val split size"

# stdout is line-buffered through a pipe: the first line arrives while the
# recipe still runs (a long run, stopped once the line is read)
mkfifo "$TMP/pipe"
"$L" recipes/gpt2.lua --steps=100000 --eval-every=0 --log-every=100000 > "$TMP/pipe" 2>/dev/null &
pid=$!
read -r first_line < "$TMP/pipe"
if kill -0 $pid 2>/dev/null; then ok; else bad "the first line came only at the end"; fi
kill $pid 2>/dev/null; wait $pid 2>/dev/null
case "$first_line" in "options: preset=tiny "*) ok ;; *) bad "first line: $first_line" ;; esac

# recipes use the Lua API only: no binding, no core module, no FFI
api_leaks() { grep -nE 'fsdp\.C\b|fsdp\.core|require *\(? *"ffi"|require *\(? *.ffi.|\bffi\.' "$@"; }
leaks=$(api_leaks recipes/*.lua)
[ -z "$leaks" ] && ok || bad "recipes touch the FFI" "$leaks"
# (the same check finds the FFI where it is used, so it can fail)
[ -n "$(api_leaks lua/fsdp/core.lua)" ] && ok || bad "the FFI check finds nothing in lua/fsdp/core.lua"

finish
