#!/usr/bin/env bash
# tools/dev/bench_plan.sh [ROUNDS] [STEPS]: the planner's predicted step against
# measured steps of the same recipe options, on this host. Calibrates first
# (kernels alone, then one host's collectives under mpirun) into a cache of
# its own, predicts each configuration once (`--plan --rank=0`), then runs
# each for real ROUNDS times, interleaved (the order rotates, each run under
# the bench lock), and prints predicted against the median of the rounds'
# median step (steps 3..STEPS, from --metrics).
#   tools/dev/bench_plan.sh 3 12
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/dev/bench_lib.sh
rounds=${1:-3}
steps=${2:-12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export FSDP_CALIBRATION=$work/calibration.json FSDP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
LOCK=${FSDP_BENCH_LOCK:-/tmp/fsdp-bench.lock}
flock "$LOCK" "$LAUNCHER" --calibrate
flock "$LOCK" "${MPIRUN[@]}" -np 2 "$LAUNCHER" --calibrate

base="recipes/gpt2.lua --preset=tiny --batch=16 --ctx=64 --eval-every=0 --sample=0 --log-every=1000"
declare -A cfg=(
  [full_shard]="--strategy=full_shard"
  [shard_grad_op]="--strategy=shard_grad_op"
  [no_shard]="--strategy=no_shard"
  [prefetch_none]="--prefetch=none"
  [limit1]="--limit=1"
  [recompute]="--recompute"
  [bf16]="--dtype=bf16"
  [no_fwd_prefetch]="--no-forward-prefetch"
  [head_chunk]="--head-chunk=64"
)
names=(full_shard shard_grad_op no_shard prefetch_none limit1 recompute bf16 no_fwd_prefetch head_chunk)
declare -A pred
for n in "${names[@]}"; do
  "$LAUNCHER" --plan --world=2 --rank=0 --plan-json="$work/$n.json" $base ${cfg[$n]} > /dev/null
  pred[$n]=$("$LAUNCHER" -e "local j = require('fsdp.json').decode(io.open('$work/$n.json'):read('*a'))
    print(string.format('%.2f %.2f', j.predicted.step_ms, j.predicted.exposed_ms))")
done
run_one() {
  local n=$1 r=$2
  flock "$LOCK" "${MPIRUN[@]}" -np 2 "$LAUNCHER" $base ${cfg[$n]} --steps="$steps" --metrics="$work/$n.$r.jsonl" \
    > /dev/null
  "$LAUNCHER" -e "local json = require 'fsdp.json'
    local ms, wait = {}, {}
    for l in io.lines('$work/$n.$r.jsonl') do
      local rec = json.decode(l)
      if rec.step_ms and rec.step >= 3 then ms[#ms + 1], wait[#wait + 1] = rec.step_ms, rec.comm_wait_ms end
    end
    table.sort(ms) table.sort(wait)
    print(string.format('%.2f %.2f', ms[math.floor((#ms + 1) / 2)], wait[math.floor((#wait + 1) / 2)]))" \
    >> "$work/$n.measured"
}
bench_rounds "$rounds" "$steps" "${names[@]}"
echo "host: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) (shared: other work runs beside these)"
printf '%-14s %10s %10s %8s %12s %12s\n' config predicted measured error pred.exposed comm_wait
errs=()
for n in "${names[@]}"; do
  read -r p pe <<< "${pred[$n]}"
  m=$(awk '{ print $1 }' "$work/$n.measured" | median_of)
  w=$(awk '{ print $2 }' "$work/$n.measured" | median_of)
  e=$(awk -v p="$p" -v m="$m" 'BEGIN { printf "%+.1f", 100 * (p - m) / m }')
  errs+=("${e#+}")
  printf '%-14s %8s ms %8s ms %7s%% %9s ms %9s ms\n' "$n" "$p" "$m" "$e" "$pe" "$w"
done
printf '%s\n' "${errs[@]}" | awk '{ v = $1 < 0 ? -$1 : $1; print v }' | sort -n | awk '{ a[NR] = $1 }
  END { printf "absolute error: median %.1f%%, worst %.1f%% over %d configurations\n", a[int((NR + 1) / 2)], a[NR], NR }'
