#!/usr/bin/env bash
# fsdp.metrics on 1 and 2 ranks (tests/sh/metrics_job.lua checks the
# records), then tools/plot draws the file into a PNG.
#   bash tests/sh/test_metrics.sh <launcher> <repo root>
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
export OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1

out=$("$L" tests/sh/metrics_job.lua "$TMP/one.jsonl" 2>&1) && ok || bad "metrics on 1 rank" "$out"
MPIRUN=$(command -v mpirun || true)
if [ -n "$MPIRUN" ]; then
  out=$("$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 -x OPENBLAS_NUM_THREADS \
        -x FSDP_NUM_THREADS "$L" tests/sh/metrics_job.lua "$TMP/two.jsonl" 2>&1) && ok || bad "metrics on 2 ranks" "$out"
else
  bad "mpirun is needed for the 2-rank metrics"
fi

# the plot: a PNG from the 2-rank file; errors for files without steps
if command -v gnuplot >/dev/null; then
  out=$(tools/plot "$TMP/two.jsonl" "$TMP/two.png" 2>&1) && ok || bad "tools/plot runs" "$out"
  if [ -s "$TMP/two.png" ] && [ "$(head -c 8 "$TMP/two.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ]; then
    ok
  else
    bad "tools/plot wrote a PNG" "$out"
  fi
  grep -q "4 steps, 1 evaluations" <<<"$out" && ok || bad "tools/plot read the steps and the evaluation" "$out"
  # a link planted at OUT is replaced, not written through
  echo sentinel > "$TMP/sentinel"; ln -s "$TMP/sentinel" "$TMP/linked.png"
  out=$(tools/plot "$TMP/two.jsonl" "$TMP/linked.png" 2>&1) && ok || bad "tools/plot over a link runs" "$out"
  [ "$(cat "$TMP/sentinel")" = sentinel ] && [ ! -L "$TMP/linked.png" ] && [ -s "$TMP/linked.png" ] && ok ||
    bad "tools/plot did not write through the planted link" "$(ls -l "$TMP")"
  [ -z "$(ls -A "$TMP" | grep '^\.plot\.')" ] && ok || bad "tools/plot left no draft behind" "$(ls -A "$TMP")"
  # several runs, one labelled line each; comm busy/exposed drawn when present (an older file has only the wait)
  grep -q '"comm_busy_ms":' "$TMP/two.jsonl" && grep -q '"comm_exposed_ms":' "$TMP/two.jsonl" && ok ||
    bad "the records carry comm busy and exposed" "$(sed -n 2p "$TMP/two.jsonl")"
  sed -E 's/"comm_(busy|exposed)_ms":[^,}]*,?//g' "$TMP/one.jsonl" > "$TMP/old.jsonl"
  ! grep -q comm_busy_ms "$TMP/old.jsonl" && ok || bad "the older-file fixture" "$(head -3 "$TMP/old.jsonl")"
  out=$(tools/plot "$TMP/one.jsonl" "$TMP/two.jsonl" "$TMP/old.jsonl" "$TMP/cmp.png" 2>&1) && ok ||
    bad "tools/plot several files" "$out"
  grep -q "3 runs: 12 steps, 3 evaluations" <<<"$out" && [ -s "$TMP/cmp.png" ] && ok ||
    bad "tools/plot read the three runs" "$out"
  printf '{"step": 1, "eval_loss": 3}\n' > "$TMP/none.jsonl"
  out=$(tools/plot "$TMP/none.jsonl" "$TMP/none.png" 2>&1); rc=$?
  [ $rc -ne 0 ] && grep -q "no training steps" <<<"$out" && ok || bad "tools/plot refuses a file without steps" "$out"
  printf '{"step": 1, "loss": 3}\n{"step": 2,\n' > "$TMP/broken.jsonl"
  out=$(tools/plot "$TMP/broken.jsonl" 2>&1); rc=$?
  [ $rc -ne 0 ] && grep -q "line 2 is not a JSON object" <<<"$out" && ok || bad "tools/plot names a broken line" "$out"
else
  bad "gnuplot is needed for tools/plot (tools/install-deps.sh installs gnuplot-nox)"
fi

# MFU's peak: the CPU's measured once and cached, FSDP_PEAK_TFLOPS per device (the CPU kept as the device on a GPU)
peak='local m = require("fsdp.metrics").new {}; print(m.peak_flops, m.peak_source)'
out1=$(XDG_CACHE_HOME="$TMP/cache" FSDP_PEAK_TFLOPS= FSDP_DEVICE=cpu "$L" -e "$peak" 2>&1)
out2=$(XDG_CACHE_HOME="$TMP/cache" FSDP_PEAK_TFLOPS= FSDP_DEVICE=cpu "$L" -e "$peak" 2>&1)
grep -q "measured now, cached in $TMP/cache/fsdp-lua/cpu_peak.json" <<<"$out1" && ok || bad "the first run measures" "$out1"
grep -q "measured once, cached in" <<<"$out2" && ok || bad "the second run reads the cache" "$out2"
[ "${out1%%[[:space:]]*}" = "${out2%%[[:space:]]*}" ] && ok || bad "the same peak in both runs" "$out1 / $out2"
out=$(FSDP_PEAK_TFLOPS=2.5 "$L" -e "$peak" 2>&1)
grep -qE "^2500000000000[[:space:]]+FSDP_PEAK_TFLOPS=2.5 per device x 1" <<<"$out" && ok || bad "FSDP_PEAK_TFLOPS" "$out"
out=$(FSDP_PEAK_TFLOPS=fast "$L" -e "$peak" 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "FSDP_PEAK_TFLOPS must be a positive number of TFLOP/s per device, as 989 (got 'fast')" \
  <<<"$out" && ok || bad "a bad FSDP_PEAK_TFLOPS is refused" "$out"

finish
