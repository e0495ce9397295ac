#!/usr/bin/env bash
# expect_abort.sh SECONDS PATTERN COMMAND...: the command must fail (non-zero
# exit, not killed by the timeout) within SECONDS and print PATTERN (grep -E).
# For jobs that must end themselves, e.g. through the collective watchdog.
limit=$1 pattern=$2
shift 2
start=$(date +%s)
out=$(timeout $((limit * 4)) "$@" 2>&1)
rc=$?
took=$(($(date +%s) - start))
echo "$out"
echo "exit $rc after ${took}s"
if [ "$rc" -eq 0 ]; then echo "FAIL: the job exited 0"; exit 1; fi
if [ "$rc" -eq 124 ] || [ "$took" -gt "$limit" ]; then echo "FAIL: the job took ${took}s (limit ${limit}s)"; exit 1; fi
if ! grep -qE "$pattern" <<<"$out"; then echo "FAIL: no line matches: $pattern"; exit 1; fi
echo "ok: ended in ${took}s with the expected message"
