#!/usr/bin/env bash
# The timeline: --trace=FILE and FSDP_TRACE=FILE on 1 and 2 ranks, checked
# by tests/sh/check_trace.lua (ranks, tracks, collectives, durations, nesting).
#   bash tests/sh/test_trace.sh <launcher> <repo root>
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
export OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1

# one rank, --trace
out=$("$L" --trace="$TMP/one.json" tests/sh/trace_job.lua 2>&1)
grep -q trained <<<"$out" && ok || bad "1 rank trains under --trace" "$out"
out=$("$L" tests/sh/check_trace.lua "$TMP/one.json" 1 3 2>&1) && ok || bad "1-rank trace checks" "$out"

# two ranks, FSDP_TRACE: one merged file
MPIRUN=$(command -v mpirun || true)
if [ -n "$MPIRUN" ]; then
  out=$(FSDP_TRACE="$TMP/two.json" "$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 2 \
        -x FSDP_TRACE -x OPENBLAS_NUM_THREADS -x FSDP_NUM_THREADS "$L" tests/sh/trace_job.lua 2>&1)
  [ "$(grep -c trained <<<"$out")" -eq 2 ] && ok || bad "2 ranks train under FSDP_TRACE" "$out"
  out=$("$L" tests/sh/check_trace.lua "$TMP/two.json" 2 3 2>&1) && ok || bad "2-rank trace checks" "$out"
  # hybrid_shard on 4 ranks: the replica all-reduces on their own track, counted in each step's busy time
  out=$(FSDP_TRACE="$TMP/hyb.json" "$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np 4 \
        -x FSDP_TRACE -x OPENBLAS_NUM_THREADS -x FSDP_NUM_THREADS "$L" tests/sh/trace_job.lua hybrid 2>&1)
  [ "$(grep -c trained <<<"$out")" -eq 4 ] && ok || bad "4 ranks train hybrid under FSDP_TRACE" "$out"
  # (CUDA tensors keep their replica reductions on lane 0: the one comm stream)
  grep -q "trained on cpu" <<<"$out" && mode=hybrid || mode=""
  out=$("$L" tests/sh/check_trace.lua "$TMP/hyb.json" 4 3 $mode 2>&1) && ok || bad "hybrid trace checks" "$out"
  # checks that must fail: a full_shard trace has no replica track
  "$L" tests/sh/check_trace.lua "$TMP/two.json" 2 3 hybrid >/dev/null 2>&1 && bad "checker wants the replica track" || ok
  # a check that must fail: the 2-rank file is not a 3-rank trace
  "$L" tests/sh/check_trace.lua "$TMP/two.json" 3 3 >/dev/null 2>&1 && bad "checker refuses a wrong rank count" || ok
else
  bad "mpirun is needed for the 2-rank trace"
fi

# off: no file; a path that cannot be written: a clear error
"$L" tests/sh/trace_job.lua >/dev/null 2>&1
[ ! -e "$TMP/none.json" ] && ok || bad "no trace without --trace"
out=$("$L" --trace="$TMP/no/such/dir/t.json" -e 'print(1)' 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "cannot write" <<<"$out" && ok || bad "unwritable trace path is an error (rc $rc)" "$out"

finish
