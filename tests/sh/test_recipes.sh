#!/usr/bin/env bash
# The GPT-2 recipe end to end, and its bad input: each mistake is a one-line
# error naming the value and what was expected, with a non-zero exit.
#   bash tests/sh/test_recipes.sh <launcher> <repo root>
set -u
L=${1:?usage: test_recipes.sh <launcher> <repo root>}
ROOT=${2:?usage: test_recipes.sh <launcher> <repo root>}
cd "$ROOT" || exit 1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1

pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $1"; [ -n "${2:-}" ] && printf '  output was:\n%s\n' "$2"; }
has() { if grep -qF -- "$3" <<<"$2"; then ok; else bad "$1: no '$3'" "$2"; fi; }
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
first=$(grep -E '^step +1 \|' <<<"$out" | sed -E 's/.*loss ([0-9.]+).*/\1/')
last=$(grep -E '^step +40 \|' <<<"$out" | sed -E 's/.*loss ([0-9.]+).*/\1/')
if awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 1.0) }'; then ok; else bad "loss falls ($first -> $last)" "$out"; fi
has "eval line" "$out" "eval loss"
has "sample line" "$out" "sample:"

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
# context longer than the model's
fails "context too long" "--ctx=100 is longer than the tiny model's context of 64" -- --ctx=100
# token ids beyond the vocabulary: GPT-2-sized ids into the byte-level tiny model
"$L" -e "local d = require 'fsdp.data'; local t = {}; for i = 1, 4000 do t[i] = 300 + i % 1000 end; d.write_shard('$TMP/big_000.bin', t, #t)" >/dev/null 2>&1
fails "token id beyond the vocabulary" "fsdp_embedding" "expected 0 <= id < 256" -- --data="$TMP/big_*.bin" --steps=1
# a one-line message: the first line names the problem (no traceback needed to see it)
out=$("$L" recipes/gpt2.lua --steps=ten 2>&1 | head -1)
has "first line" "$out" "--steps expects an integer"

echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
