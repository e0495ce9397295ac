#!/usr/bin/env bash
# expect_fail.sh: runs a command that must FAIL: within 60 s (a hang is a
# test failure), with a non-zero exit status, and with output (stdout and
# stderr together) matching every expected pattern. Prints what it saw.
#   bash expect_fail.sh [-t SECONDS] -e REGEX [-e REGEX ...] -- COMMAND [ARGS...]
# REGEX is an extended regular expression (grep -E). Exit 0 when all holds.
set -u
limit=60
patterns=()
while [ $# -gt 0 ]; do
  case "$1" in
    -t) limit=${2:?-t needs seconds}; shift 2 ;;
    -e) patterns+=("${2:?-e needs a pattern}"); shift 2 ;;
    --) shift; break ;;
    *) echo "expect_fail.sh: unknown option '$1' (usage: expect_fail.sh [-t S] -e REGEX ... -- COMMAND ...)"; exit 2 ;;
  esac
done
if [ $# -eq 0 ] || [ ${#patterns[@]} -eq 0 ]; then
  echo "expect_fail.sh: need at least one -e REGEX and a command after --"
  exit 2
fi

out=$(timeout --kill-after=10 "$limit" "$@" 2>&1)
rc=$?
echo "---- output of: $* ----"
printf '%s\n' "$out"
echo "---- exit status $rc ----"

status=0
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  echo "FAIL: no result within ${limit} s (a hang)"
  status=1
elif [ $rc -eq 0 ]; then
  echo "FAIL: the command succeeded; a non-zero exit was expected"
  status=1
fi
for p in "${patterns[@]}"; do
  if grep -Eq -- "$p" <<<"$out"; then
    echo "ok: output matches '$p'"
  else
    echo "FAIL: output lacks '$p'"
    status=1
  fi
done
[ $status -eq 0 ] && echo "PASS: failed as expected (exit $rc)"
exit $status
