#!/usr/bin/env bash
# The GPT-2 recipe as a newcomer uses it: samples (prompt, sampler options,
# several samples, samples during training), evaluating or sampling a
# checkpoint without training, and the first mistakes' messages.
#   bash tests/sh/user_options.sh <launcher> <repo root>
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
export OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1 LC_ALL=C

# usage NAME TEXT ARGS...: exit status 2 and one line holding TEXT
usage() {
  local name=$1 want=$2; shift 2
  local out rc
  out=$("$L" "$@" 2>&1); rc=$?
  if [ $rc -ne 2 ]; then bad "$name: exit $rc, want 2" "$out"; return; fi
  if [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ]; then ok; else bad "$name: more than one line" "$out"; fi
  has "$name" "$out" "$want"
}
G="recipes/gpt2.lua --eval-every=0 --log-every=100"
conts() { grep -F 'continuation |' <<<"$1"; }

# --- samples: the prompt set off from the continuation, several of them, during training too
out=$("$L" $G --steps=4 --prompt='ROMEO: ' --num-samples=3 --sample=10 --sample-every=2 --save-every=4 \
  --save-dir="$TMP/ck" 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "sampling run exit $rc" "$out"
has "prompt line" "$out" "  prompt       | ROMEO: "
has "sample 3 of 3" "$out" "sample 3/3 after step 4 (temperature 0.8, top-k 40, seed 1):"
has "sample during training" "$out" "sample 1/3 at step 2"
hasnt "not again at the last step" "$out" "at step 4"
[ "$(conts "$out" | wc -l)" -eq 6 ] && ok || bad "six samples" "$out"
end3=$(grep -A2 -F 'after step 4' <<<"$out" | grep -F 'continuation |')
# three draws from one prompt differ (the byte model after 4 steps is far from certain)
[ "$(sort -u <<<"$end3" | wc -l)" -gt 1 ] && ok || bad "the samples differ" "$out"
for c in $(seq 1 3); do
  line=$(sed -n "${c}p" <<<"$end3")
  [ ${#line} -eq $((17 + 10)) ] && ok || bad "continuation $c is 10 characters: '$line'"
done

# --- --generate-only from the checkpoint: the same samples as the end of the run (same seed, same weights)
out2=$("$L" $G --steps=4 --resume --save-dir="$TMP/ck" --generate-only --prompt='ROMEO: ' --num-samples=3 --sample=10 2>&1)
same "generate-only repeats the run's samples" "$(conts "$out2")" "$end3"
hasnt "generate-only trains nothing" "$out2" "ms/step"
# another seed, another text; greedy is one text for every sample
out3=$("$L" $G --steps=4 --resume --save-dir="$TMP/ck" --generate-only --prompt='ROMEO: ' --num-samples=3 --sample=10 \
  --sample-seed=9 2>&1)
[ "$(conts "$out3")" != "$end3" ] && ok || bad "another seed" "$out3"
out4=$("$L" $G --steps=4 --resume --save-dir="$TMP/ck" --generate-only --num-samples=2 --temperature=0 --sample=5 2>&1)
has "greedy named" "$out4" "(greedy, seed 1)"
[ "$(conts "$out4" | sort -u | wc -l)" -eq 1 ] && ok || bad "greedy samples are one text" "$out4"
out5=$("$L" $G --steps=4 --resume --save-dir="$TMP/ck" --generate-only --top-p=0.5 --top-k=0 --sample=5 2>&1)
has "top-p named" "$out5" "(temperature 0.8, top-k off, top-p 0.5, seed 1)"

# --- --eval-only: the checkpoint's held-out loss, as the uninterrupted run's evaluation at that step
ref=$("$L" recipes/gpt2.lua --steps=4 --eval-every=4 --sample=0 --log-every=100 2>&1 | grep -F 'eval loss')
ev=$("$L" $G --steps=4 --resume --save-dir="$TMP/ck" --eval-only 2>&1)
same "eval-only = the run's evaluation" "$(grep -F 'eval loss' <<<"$ev")" "$ref"
hasnt "eval-only samples nothing" "$ev" "continuation |"
hasnt "eval-only trains nothing" "$ev" "ms/step"
ls "$TMP/ck" | grep -q step_00000004 && [ "$(ls "$TMP/ck" | wc -l)" -eq 1 ] && ok || bad "eval-only saves nothing"

# --- mistakes
usage "eval-only without weights" "--eval-only needs weights: --resume[=PATH] (a checkpoint) or --init=FILE" \
  recipes/gpt2.lua --eval-only
usage "generate-only, nothing to resume" "--generate-only: no checkpoint in $TMP/none to start from" \
  recipes/gpt2.lua --generate-only --resume --save-dir="$TMP/none"
usage "top-p 0" "--top-p must be above 0" recipes/gpt2.lua --top-p=0
usage "top-p 2" "--top-p must be at most 1, got 2" recipes/gpt2.lua --top-p=2
usage "empty prompt" "--prompt is empty" recipes/gpt2.lua --prompt=

# launcher options after the recipe say where they go
usage "--trace after the recipe" "--trace is an fsdp-lua option: put it before the recipe (fsdp-lua --trace=t.json" \
  recipes/gpt2.lua --trace=t.json
usage "--plan after the recipe" "--plan is an fsdp-lua option: put it before the recipe" recipes/gpt2.lua --plan
usage "-i after the recipe" "-i is an fsdp-lua option: put it before the recipe" recipes/gpt2.lua -i
# GPT-2 token shards with the byte-level preset: said before a model is built
mkdir -p "$TMP/g"
"$L" -e "local d = require 'fsdp.data'; local t = { 50256 }; for i = 2, 3000 do t[i] = (i * 7919) % 50257 end
  d.write_shard('$TMP/g/train_000000.bin', t, #t); d.write_shard('$TMP/g/val_000000.bin', t, #t)"
usage "GPT-2 shards, tiny preset" "--data=$TMP/g: '$TMP/g/train_000000.bin' holds token id 50256 at token 0, beyond the tiny model's vocabulary of 256: \
these look like GPT-2 token ids (vocabulary 50257): use --preset=small" recipes/gpt2.lua --data="$TMP/g"
out=$("$L" recipes/gpt2.lua --data="$TMP/g" --preset=small --steps=1 --batch=1 --ctx=8 --eval-every=0 --sample=0 2>&1)
[ $? -eq 0 ] && ok || bad "the same shards train the small preset" "$out"
# the data options are named
usage "missing --data" "gpt2.lua: --data=$TMP/nope.txt: No such file or directory" recipes/gpt2.lua --data="$TMP/nope.txt"
usage "missing --val-data" "gpt2.lua: --val-data=$TMP/nope.bin: No such file or directory" recipes/gpt2.lua \
  --val-data="$TMP/nope.bin"
# make_shards.lua takes options as a recipe does
out=$("$L" tools/make_shards.lua --help 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "make_shards --help exits $rc" "$out"
for o in --input --out --tokenizer --tokenizer-dir --val-fraction --shard-tokens; do has "make_shards --help" "$out" "  $o "; done
usage "make_shards typo" "make_shards.lua: unknown option --shard-token (did you mean --shard-tokens?" \
  tools/make_shards.lua --shard-token=5
usage "make_shards val fraction" "--val-fraction must be below 1, got 1" tools/make_shards.lua --input=data/corpus.txt \
  --out="$TMP/s" --val-fraction=1

finish
