#!/usr/bin/env bash
# Ranks agree on the options that change the training: one rank started
# with another --lr, --clip or --data fails every rank, before any step, with
# the option and both values; a rank-local option (--threads) may differ;
# fsdp.distributed.broadcast with different roots fails on every rank.
#   bash agree_options.sh MPIRUN... -- LAUNCHER
set -u
mpirun=()
while [ "$1" != "--" ]; do mpirun+=("$1"); shift; done
shift
L=${1:?usage: agree_options.sh MPIRUN... -- LAUNCHER}
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $1"; [ -n "${2:-}" ] && printf '  output was:\n%s\n' "$2"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Each rank runs the recipe with the common options plus its own: rank R's
# extra options are in $tmp/extra.R (none when absent).
cat >"$tmp/rank.sh" <<WRAP
#!/usr/bin/env bash
extra=()
[ -f "$tmp/extra.\$OMPI_COMM_WORLD_RANK" ] && read -r -a extra <"$tmp/extra.\$OMPI_COMM_WORLD_RANK"
exec "$L" recipes/gpt2.lua --steps=2 --warmup=1 --log-every=1 --eval-every=0 --sample=0 "\$@" "\${extra[@]}"
WRAP
chmod +x "$tmp/rank.sh"
common=(--data=data/corpus.txt)
run() { # run NP: the job, 60 s at most
  timeout --kill-after=10 60 "${mpirun[@]}" "$1" "$tmp/rank.sh" "${@:2}" 2>&1
}
no_step() { ! grep -qE '^step +[0-9]+(/[0-9]+)? \|' <<<"$1"; }

echo "--lr=0.002" >"$tmp/extra.2"
out=$(run 3 "${common[@]}"); rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && ok || bad "3 ranks, rank 2 with another --lr: non-zero exit, no hang (rc $rc)" "$out"
grep -qF "gpt2.lua: option --lr differs between ranks: rank 0 has 0.001, rank 2 has 0.002" <<<"$out" && ok ||
  bad "the message names --lr, rank 0's value and rank 2's" "$out"
grep -qF -- "only --threads may differ" <<<"$out" && ok || bad "the message names the rank-local options" "$out"
no_step "$out" && ok || bad "no step ran" "$out"
rm -f "$tmp"/extra.*

echo "--clip=0.5" >"$tmp/extra.1"
out=$(run 2 "${common[@]}"); rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && ok || bad "2 ranks, rank 1 with another --clip: non-zero exit (rc $rc)" "$out"
grep -qF "option --clip differs between ranks: rank 0 has 1, rank 1 has 0.5" <<<"$out" && ok ||
  bad "the message names --clip and both values" "$out"
no_step "$out" && ok || bad "no step ran (--clip)" "$out"
rm -f "$tmp"/extra.*

# the same path, other content: the data differ though the option reads alike
mkdir -p "$tmp/r0" "$tmp/r1"
head -c 300000 data/corpus.txt >"$tmp/r0/corpus.txt"
head -c 300000 data/corpus.txt | tr 'e' 'E' >"$tmp/r1/corpus.txt"
cat >"$tmp/cd.sh" <<WRAP
#!/usr/bin/env bash
cd "$tmp/r\$OMPI_COMM_WORLD_RANK" && exec "$L" "$PWD/recipes/gpt2.lua" --steps=2 --eval-every=0 --sample=0 --data=corpus.txt
WRAP
chmod +x "$tmp/cd.sh"
out=$(timeout --kill-after=10 60 "${mpirun[@]}" 2 "$tmp/cd.sh" 2>&1); rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && ok || bad "rank 1's data file has other content: non-zero exit (rc $rc)" "$out"
grep -qE "option --data differs between ranks: rank 0 has corpus.txt \([0-9]+ bytes, content [0-9a-f]{16}\), rank 1 has corpus.txt \([0-9]+ bytes, content [0-9a-f]{16}\)" <<<"$out" && ok ||
  bad "the message names --data, its size and both content hashes" "$out"
no_step "$out" && ok || bad "no step ran (--data)" "$out"

echo "--data=$tmp/r1/corpus.txt" >"$tmp/extra.1"
out=$(run 2 "${common[@]}"); rc=$?
grep -qF "option --data differs between ranks: rank 0 has data/corpus.txt (" <<<"$out" &&
  grep -qF "rank 1 has $tmp/r1/corpus.txt (" <<<"$out" && [ $rc -ne 0 ] && ok ||
  bad "another --data path on rank 1: both paths named (rc $rc)" "$out"
rm -f "$tmp"/extra.*

# rank-local: --threads may differ, and the run trains
echo "--threads=2" >"$tmp/extra.1"
out=$(run 2 "${common[@]}" --threads=1); rc=$?
[ $rc -eq 0 ] && ok || bad "--threads differing between ranks is fine (rc $rc)" "$out"
[ "$(grep -cE '^step +[0-9]+(/[0-9]+)? \|' <<<"$out")" -eq 2 ] && ok || bad "the run with different --threads trains 2 steps" "$out"
rm -f "$tmp"/extra.*

# broadcast: ranks naming different roots fail together, naming both
cat >"$tmp/roots.lua" <<'LUA'
local dist = require "fsdp.distributed"
local root = dist.rank() == 2 and 1 or 0
local ok, err = pcall(dist.broadcast, "x", root)
assert(not ok, "a broadcast with different roots must fail")
io.stdout:write(string.format("rank %d: %s\n", dist.rank(), tostring(err)))
-- the same root everywhere still works afterwards
assert(dist.broadcast(dist.rank() == 1 and "from one" or "", 1) == "from one")
io.stdout:write(string.format("rank %d: recovered\n", dist.rank()))
LUA
out=$(timeout --kill-after=10 60 "${mpirun[@]}" 3 "$L" "$tmp/roots.lua" 2>&1); rc=$?
[ $rc -eq 0 ] && ok || bad "the roots script runs (rc $rc)" "$out"
n=$(grep -cF "ranks name different roots: rank 0 names root 0, rank 2 names root 1" <<<"$out")
[ "$n" -eq 3 ] && ok || bad "every rank of 3 reports both roots ($n)" "$out"
[ "$(grep -c 'recovered' <<<"$out")" -eq 3 ] && ok || bad "a later broadcast works on every rank" "$out"

echo "agree_options: $pass passed, $fail failed"
[ $fail -eq 0 ]
