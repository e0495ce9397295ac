#!/usr/bin/env bash
# tools/netcluster: the tiny recipe across 2 "nodes" joined by a shaped link
# logs the same losses and gradient norms, bit for bit, as the same ranks on
# one host (2 nodes x 1 rank; 2 nodes x 2 ranks with hybrid_shard, one shard
# group per node); ranks see their own node's hostname and local rank; bad
# options and a failing command are one line, non-zero, and leave nothing; a
# run killed with -9 is cleaned up by the next, which works.
source "$(dirname "$0")/lib.sh"

recipe=(recipes/gpt2.lua --steps=5 --log-every=1 --eval-every=0 --sample=0)

# 2 nodes x 1 rank, full_shard, against 2 ranks on this host
out=$("$NC" run --nodes=2 --ranks-per-node=1 --rate=1gbit -- "$L" "${recipe[@]}" --metrics="$TMP/net2.jsonl" 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q '^done: 5 steps' <<<"$out" && ok || bad "2 nodes x 1 rank: the recipe exits $rc" "$out"
out=$("${MPIRUN[@]}" 2 "$L" "${recipe[@]}" --metrics="$TMP/host2.jsonl" 2>&1) || bad "2 ranks on one host" "$out"
a=$(losses_of "$TMP/net2.jsonl"); b=$(losses_of "$TMP/host2.jsonl")
[ "$(wc -l <<<"$a")" -eq 5 ] && [ "$a" = "$b" ] && ok || bad "2 nodes x 1 rank: the losses equal one host's, bit for bit" "$a
--- one host:
$b"

# 2 nodes x 2 ranks, hybrid_shard: shard groups {0,1} (node0) and {2,3}
# (node1), the replicas' reduction across the link
hy=(--strategy=hybrid_shard --group-size=2 --batch=8)
out=$("$NC" run --nodes=2 --ranks-per-node=2 --rate=1gbit -- "$L" "${recipe[@]}" "${hy[@]}" \
  --metrics="$TMP/net4.jsonl" 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q '^done: 5 steps' <<<"$out" && ok || bad "2 nodes x 2 ranks hybrid: exits $rc" "$out"
out=$("${MPIRUN[@]}" 4 "$L" "${recipe[@]}" "${hy[@]}" --metrics="$TMP/host4.jsonl" 2>&1) || bad "4 ranks on one host" "$out"
a=$(losses_of "$TMP/net4.jsonl"); b=$(losses_of "$TMP/host4.jsonl")
[ "$(wc -l <<<"$a")" -eq 5 ] && [ "$a" = "$b" ] && ok || bad "2 nodes x 2 ranks hybrid: the losses equal one host's" "$a
--- one host:
$b"

# each rank on its own node: hostname, and Open MPI's view of where it runs
out=$("$NC" run --nodes=2 --ranks-per-node=2 -- sh -c 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname)"' 2>&1)
want="rank 0 on node0
rank 1 on node0
rank 2 on node1
rank 3 on node1"
[ "$(sort <<<"$out")" = "$want" ] && ok || bad "ranks 0,1 on node0 and 2,3 on node1" "$out"
# the engine's own placement (MPI's shared-memory split, not the launcher's variables): local ranks 0,1 per node
out=$(FSDP_NUM_THREADS=1 "$NC" run --nodes=2 --ranks-per-node=2 -- "$L" --verbose -e 'x = 1' 2>&1)
want=$(for r in 0 1 2 3; do echo "rank $r of 4 on host node$((r / 2)): local rank $((r % 2)) of 2, device cpu (1 threads)"; done)
[ "$(grep '^rank ' <<<"$out")" = "$want" ] && ok || bad "--verbose: each node's local ranks 0 and 1" "$out"
# the addresses are the namespaces' own: node1 reaches node0, and nothing else
out=$("$NC" run --nodes=2 -- sh -c 'ip -4 route; ip -4 -o addr show eth0' 2>&1)
! grep -q default <<<"$out" && grep -q '10.213.0.1/24' <<<"$out" && grep -q '10.213.0.2/24' <<<"$out" && ok ||
  bad "each node has its address on eth0 and no default route" "$out"

# mistakes: one line, exit 2, nothing made
expect_error() {
  local what=$1 pattern=$2; shift 2
  local before out rc
  before=$(ip netns list | grep -c '^netcl-')
  out=$("$NC" "$@" 2>&1); rc=$?
  [ $rc -ne 0 ] && [ $rc -ne 77 ] && [ "$(wc -l <<<"$out")" -eq 1 ] && grep -q "$pattern" <<<"$out" && ok ||
    bad "$what: one line matching '$pattern', non-zero exit (got $rc)" "$out"
  [ "$(ip netns list | grep -c '^netcl-')" -eq "$before" ] && ok || bad "$what: leaves no namespace" "$(ip netns list)"
}
expect_error "a bad rate" "^netcluster: --rate='fast' is not a rate" run --nodes=2 --rate=fast -- true
expect_error "a zero rate" "^netcluster: --rate='0gbit' is not a rate" run --nodes=2 --rate=0gbit -- true
expect_error "zero nodes" "^netcluster: --nodes=0 is out of range (expected 1..16)" run --nodes=0 -- true
expect_error "too many ranks" "^netcluster: --ranks-per-node=33 is out of range (expected 1..32)" \
  run --nodes=2 --ranks-per-node=33 -- true
expect_error "no command" "^netcluster: no command after '--'" run --nodes=2 --
expect_error "a bad delay" "^netcluster: --delay='soon' is not a delay" run --nodes=2 --delay=soon -- true
expect_error "an unknown option" "^netcluster: unknown option '--speed=1'" run --nodes=2 --speed=1 -- true

# a failing command: its exit status, one line of ours, nothing left behind
out=$("$NC" run --nodes=2 --rate=100mbit -- sh -c 'exit 5' 2>"$TMP/err"); rc=$?
err=$(grep '^netcluster:' "$TMP/err")
[ $rc -ne 0 ] && [ "$(wc -l <<<"$err")" -eq 1 ] && grep -q "the command failed (exit $rc)" <<<"$err" && ok ||
  bad "a failing command: non-zero, one line (got $rc)" "$(cat "$TMP/err")"
[ -z "$(ip netns list | grep '^netcl-')" ] && [ -z "$(tc qdisc show | grep -E 'dev nc[0-9]+[dc]')" ] && ok ||
  bad "a failing command leaves no namespace or qdisc" "$(ip netns list; tc qdisc show)"

# which of these processes still run after up to 10 s (dead ones may wait a
# moment to be reaped by init)
still_alive() {
  local q left
  for _ in $(seq 100); do
    left=""
    for q in "$@"; do [ -d /proc/$q ] && [ "$(awk '{print $3}' /proc/$q/stat 2>/dev/null)" != Z ] && left+="$q "; done
    [ -z "$left" ] && return
    sleep 0.1
  done
  echo "$left"
}

# the processes inside run P's namespaces once its command (sleep) runs
# there, waiting up to 30 s (set-up steps come and go in them before)
inside_of() {
  local q found=""
  for _ in $(seq 300); do
    found=$(ip netns pids "netcl-$1-node0" 2>/dev/null; ip netns pids "netcl-$1-node1" 2>/dev/null)
    for q in $found; do [ "$(cat /proc/$q/comm 2>/dev/null)" = sleep ] && { echo $found; return; }; done
    sleep 0.1
  done
  echo $found
}

# interrupted (Ctrl-C: INT; a job's end: TERM): everything torn down, its
# command's processes too. Started through python so that INT is not ignored
# as it is for a script's background jobs.
for sig in INT TERM; do
  python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])' \
    "$NC" run --nodes=2 -- sleep 30 >/dev/null 2>&1 &
  p=$!
  inside=$(inside_of $p)
  [ -n "$inside" ] && ok || bad "$sig: the run has processes in its namespaces"
  kill -$sig $p; wait $p; rc=$?
  [ $rc -ne 0 ] && ok || bad "$sig: the run exits non-zero"
  left=$(left_of $p)
  [ -z "$left" ] && ok || bad "$sig: nothing of the run is left" "$left"
  alive=$(still_alive $inside)
  [ -z "$alive" ] && ok || bad "$sig: the processes inside are gone" "$alive"
done

# killed with -9 mid-run: what it left is cleaned by the next run, which works
"$NC" run --nodes=2 -- sleep 30 >/dev/null 2>&1 &
killed=$!
inside=$(inside_of $killed)
[ -n "$(left_of $killed)" ] && [ -n "$inside" ] && ok || bad "the run to be killed has its namespaces"
kill -9 $killed; wait $killed 2>/dev/null
out=$("$NC" run --nodes=2 -- hostname 2>&1); rc=$?
[ $rc -eq 0 ] && [ "$(sort <<<"$out" | tr '\n' ' ')" = "node0 node1 " ] && ok || bad "a run after a killed one works" "$out"
left=$(left_of $killed)
[ -z "$left" ] && ok || bad "the killed run's namespaces, bridge, links are gone" "$left"
alive=$(still_alive $inside)
[ -z "$alive" ] && ok || bad "the killed run's processes are gone" "$alive"

finish
