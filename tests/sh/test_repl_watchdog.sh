#!/usr/bin/env bash
# The REPL across ranks never hangs silently: a chunk that never ends on one
# rank (an endless loop) is reported within FSDP_REPL_REJOIN_SECONDS naming
# the rank, interrupted, and the session goes on (or, with 0 or a rank that
# cannot be interrupted, the job ends with that message); exit() on one
# rank ends every rank with a message naming it and its status.
#   bash tests/sh/test_repl_watchdog.sh <launcher> <repo root>
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh" "$@"
export OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1 HOME="$TMP"
MPIRUN=$(command -v mpirun || true)
[ -n "$MPIRUN" ] || { echo "FAIL: mpirun is needed"; exit 1; }
M=("$MPIRUN" --allow-run-as-root --oversubscribe --mca btl self,vader -np)
sum_line() { grep -cxF "$(printf 'after\t%s' "$2")" <<<"$1"; }

# an endless loop on rank 1 of 3, through a pipe: reported, interrupted, the
# next chunk runs on every rank (its collective matches)
out=$(printf 'if fsdp.rank() == 1 then while true do end end\nprint("after", fsdp.distributed.sum(1))\n' |
      FSDP_REPL_REJOIN_SECONDS=2 timeout 60 "${M[@]}" 3 "$L" 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "3 ranks, a loop on rank 1: the session goes on and ends 0 (rc $rc)" "$out"
has "3 ranks, loop on rank 1" "$out" "fsdp-lua: rank 1 did not finish chunk 1 within 2 s (FSDP_REPL_REJOIN_SECONDS; an endless loop?): interrupting it"
has "3 ranks, loop on rank 1: its chunk is reported" "$out" "[rank 1] interrupted"
[ "$(sum_line "$out" 3)" -eq 3 ] && ok || bad "3 ranks: the next chunk runs on all 3 ranks" "$out"

# the loop on rank 0 (the rank that reads the input)
out=$(printf 'if fsdp.rank() == 0 then while true do end end\nprint("after", fsdp.distributed.sum(1))\n' |
      FSDP_REPL_REJOIN_SECONDS=2 timeout 60 "${M[@]}" 2 "$L" 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "2 ranks, a loop on rank 0: ends 0 (rc $rc)" "$out"
has "2 ranks, loop on rank 0" "$out" "fsdp-lua: rank 0 did not finish chunk 1 within 2 s"
[ "$(sum_line "$out" 2)" -eq 2 ] && ok || bad "2 ranks: the next chunk runs on both ranks" "$out"

# a rank that an interrupt does not stop (a blocking child process): the job ends, naming it
out=$(printf 'if fsdp.rank() == 1 then os.execute("sleep 30") end\nprint("after", fsdp.distributed.sum(1))\n' |
      FSDP_REPL_REJOIN_SECONDS=2 timeout 60 "${M[@]}" 2 "$L" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && ok || bad "a rank stuck in a child process: the job ends non-zero, no hang (rc $rc)" "$out"
has "stuck rank 1" "$out" "rank 1 did not finish chunk 1 within 2 s (FSDP_REPL_REJOIN_SECONDS) after being interrupted: ending the job"

# FSDP_REPL_REJOIN_SECONDS=0: no interrupt; the job ends after 10 s, naming the rank
out=$(printf 'if fsdp.rank() == 1 then while true do end end\nprint("after", fsdp.distributed.sum(1))\n' |
      FSDP_REPL_REJOIN_SECONDS=0 timeout 60 "${M[@]}" 2 "$L" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && ok || bad "FSDP_REPL_REJOIN_SECONDS=0: the job ends (rc $rc)" "$out"
has "REJOIN 0" "$out" "fsdp-lua: rank 1 did not finish chunk 1 within 10 s (FSDP_REPL_REJOIN_SECONDS): ending the job"

# exit() on one rank: every rank leaves with its status, and a message names it
out=$(printf 'if fsdp.rank() == 2 then exit(3) end\nprint("later")\n' | timeout 60 "${M[@]}" 3 "$L" 2>&1); rc=$?
[ $rc -eq 3 ] && ok || bad "exit(3) on rank 2 of 3: the job's status is 3 (rc $rc)" "$out"
has "exit on rank 2" "$out" "fsdp-lua: rank 2 called exit(3): ending the REPL on every rank (exit status 3)"
hasnt "exit on rank 2: no later chunk runs" "$out" "later"
hasnt "exit on rank 2: no abort" "$out" "MPI_ABORT"
out=$(printf 'if fsdp.rank() == 1 then exit() end\nprint("later")\n' | timeout 60 "${M[@]}" 2 "$L" 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "exit() on rank 1 of 2: status 0 (rc $rc)" "$out"
has "exit() on rank 1" "$out" "fsdp-lua: rank 1 called exit(0): ending the REPL on every rank (exit status 0)"
out=$(printf 'exit(4)\nprint("later")\n' | timeout 60 "${M[@]}" 2 "$L" 2>&1); rc=$?
[ $rc -eq 4 ] && ok || bad "exit(4) on every rank: status 4 (rc $rc)" "$out"
hasnt "exit(4) everywhere: no abort" "$out" "MPI_ABORT"
hasnt "exit(4) everywhere: no per-rank message" "$out" "called exit"

# at a terminal (a pseudo-terminal in front of mpirun): the loop on rank 1
# is reported and the prompt comes back
PY=$(command -v python3 || true)
if [ -n "$PY" ]; then
  cat > "$TMP/loop.steps" <<'STEPS'
expect fsdp> 
isig off
send if fsdp.rank() == 1 then while true do end end\n
expect rank 1 did not finish chunk 1 within 2 s
expect fsdp> 
send print("after" .. "_pty", fsdp.distributed.sum(1))\n
expect after_pty
expect fsdp> 
send \x04
wait 0
isig on
STEPS
  out=$(FSDP_REPL_REJOIN_SECONDS=2 timeout 60 "$PY" tests/sh/repl_pty.py "$TMP/loop.steps" -- \
        "${M[@]}" 2 "$L" 2>&1)
  has "pty, 2 ranks: a loop on rank 1 reported naming it, the prompt back" "$out" "ALL_OK"
else
  bad "python3 is needed for the pseudo-terminal test"
fi

finish
