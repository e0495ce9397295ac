#!/usr/bin/env bash
# recipes/gpt2.lua as the README runs it, on 2 ranks (tiny preset, a short
# run): it exits 0, the log parses, the loss falls, evaluation and the
# sample are there, every log line comes once (from rank 0), option
# mistakes are one line, printed once, with exit status 2, and a run resumed
# from a checkpoint goes on as the uninterrupted run did.
#   bash recipe_gpt2.sh MPIRUN... -- LAUNCHER
set -u
mpirun=()
while [ "$1" != "--" ]; do mpirun+=("$1"); shift; done
shift
L=${1:?usage: recipe_gpt2.sh MPIRUN... -- LAUNCHER}
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $1"; [ -n "${2:-}" ] && printf '  output was:\n%s\n' "$2"; }

out=$("${mpirun[@]}" 2 "$L" recipes/gpt2.lua --steps=12 --warmup=2 --lr=3e-3 --log-every=4 --eval-every=6 \
  --eval-steps=1 --sample=8 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "2-rank run exits $rc" "$out"
grep -qF "2 rank(s), full_shard, wrap block" <<<"$out" && ok || bad "the header names 2 ranks" "$out"
losses=$(grep -E '^step +[0-9]+/[0-9]+ \| loss [0-9.]+ \|' <<<"$out" | sed -E 's/^step +([0-9]+)\/[0-9]+ \| loss ([0-9.]+) .*/\1 \2/')
n=$(wc -l <<<"$losses")
[ "$n" -eq 4 ] && ok || bad "4 loss lines (steps 1, 4, 8, 12), got $n" "$out"
first=$(awk '$1 == 1 { print $2 }' <<<"$losses")
last=$(awk '$1 == 12 { print $2 }' <<<"$losses")
if awk -v a="$first" -v b="$last" 'BEGIN { exit !(a > 5 && a < 6 && b < a - 0.5) }'; then ok; else
  bad "loss starts near ln(256) = 5.55 and falls ($first -> $last)" "$out"; fi
[ "$(grep -c 'eval loss' <<<"$out")" -eq 2 ] && ok || bad "two evaluations (steps 6 and 12)" "$out"
[ "$(grep -c '^sample 1/1 ' <<<"$out")" -eq 1 ] && [ "$(grep -c '^  continuation | ' <<<"$out")" -eq 1 ] && ok ||
  bad "one sample, its lines once" "$out"
[ "$(grep -c '^done: 12 steps' <<<"$out")" -eq 1 ] && ok || bad "one done line" "$out"

out=$("${mpirun[@]}" 2 "$L" recipes/gpt2.lua --stpes=3 2>&1); rc=$?
[ $rc -ne 0 ] && ok || bad "a typo fails" "$out"
[ "$(grep -c 'gpt2.lua: unknown option --stpes (did you mean --steps?' <<<"$out")" -eq 1 ] && ok ||
  bad "the typo's message, once" "$out"
grep -q "traceback" <<<"$out" && bad "no traceback for an option error" "$out" || ok
out=$("${mpirun[@]}" 2 "$L" recipes/gpt2.lua --batch=3 2>&1); rc=$?
[ $rc -ne 0 ] && [ "$(grep -c 'batch=3 is not divisible by 2 ranks' <<<"$out")" -eq 1 ] && ok ||
  bad "a batch the ranks cannot split, once" "$out"

# the Llama with its untied lm_head an FSDP unit of its own (a size policy):
# the recipe's loss-only forward gathers it (its forward makes the logits)
out=$("${mpirun[@]}" 2 "$L" recipes/gpt2.lua --model=llama --wrap=size --wrap-size=1000 --steps=2 --eval-every=0 \
  --sample=0 2>&1); rc=$?
[ $rc -eq 0 ] && [ "$(grep -c '^done: 2 steps' <<<"$out")" -eq 1 ] && ok ||
  bad "llama, lm_head a unit of its own, 2 ranks: exits $rc" "$out"

# checkpoints: a run resumed from its step-3 checkpoint logs the same steps 4-6
# as the run that went on (same schedule: --steps=6 both times)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
args=(recipes/gpt2.lua --steps=6 --log-every=1 --eval-every=0 --sample=0 --save-every=3 --save-dir="$TMP/ck")
steps_of() { grep -E '^step +[4-6]/[0-9]+ \| loss' <<<"$1" | sed -E 's/^(step +[0-9]+\/[0-9]+ \| loss [0-9.]+) .*/\1/'; }
whole=$("${mpirun[@]}" 2 "$L" "${args[@]}" 2>&1); rc=$?
[ $rc -eq 0 ] && [ -d "$TMP/ck/step_00000003" ] && [ -d "$TMP/ck/step_00000006" ] && ok ||
  bad "a 2-rank run saves at steps 3 and 6" "$whole"
resumed=$("${mpirun[@]}" 2 "$L" "${args[@]}" --resume="$TMP/ck/step_00000003" 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "the resumed run exits $rc" "$resumed"
[ "$(grep -c "^resumed from $TMP/ck/step_00000003 (saved by 2 rank(s)): step 3" <<<"$resumed")" -eq 1 ] && ok ||
  bad "one line says where it resumed from" "$resumed"
grep -qE '^step +[1-3]/[0-9]+ \| loss' <<<"$resumed" && bad "the resumed run starts at step 4" "$resumed" || ok
a=$(steps_of "$whole"); b=$(steps_of "$resumed")
[ "$(wc -l <<<"$a")" -eq 3 ] && [ "$a" = "$b" ] && ok || bad "steps 4-6 resumed equal steps 4-6 run through" "$a
--- resumed:
$b"

# the resumed run went on from step 3: the first run's step 6 moved aside, its own in place
ls "$TMP"/ck/abandoned/*/step_00000006/index.json >/dev/null 2>&1 && [ -f "$TMP/ck/step_00000006/index.json" ] && ok ||
  bad "the rolled-back run moved the abandoned step 6 aside" "$resumed"
# resumed at its last step: nothing to train, but the evaluation asked for
out=$("${mpirun[@]}" 2 "$L" "${args[@]}" --resume --steps=3 --eval-every=5 --eval-steps=1 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q "the checkpoint is at step 6, the run ends at step 3: nothing to train" <<<"$out" &&
  grep -qE '^step +6 \| eval loss' <<<"$out" && ! grep -q '^done:' <<<"$out" && ok ||
  bad "--steps below the checkpoint's step: nothing to train, one evaluation" "$out"

# a learning rate that blows the model up: the run stops at the step whose loss
# is not finite, exit status 3, one line; the checkpoint before it is kept
out=$("${mpirun[@]}" 2 "$L" recipes/gpt2.lua --steps=4 --lr=1e30 --warmup=0 --eval-every=0 --sample=0 \
  --save-every=1 --keep=1 --save-dir="$TMP/nan" 2>&1); rc=$?
[ $rc -eq 3 ] && ok || bad "a NaN loss exits 3, got $rc" "$out"
[ "$(grep -c '^gpt2.lua: step 2: the loss is nan on rank 0.*training stopped, nothing saved from this state' \
  <<<"$out")" -eq 1 ] && ok || bad "one line names the step, the value and the rank" "$out"
[ -f "$TMP/nan/step_00000001/index.json" ] && [ ! -e "$TMP/nan/step_00000002" ] && ok ||
  bad "the step-1 checkpoint is kept, none from step 2" "$(ls -R "$TMP/nan")"

echo "$pass passed, $fail failed"
[ $fail -eq 0 ] && [ $pass -gt 0 ]
