#!/usr/bin/env bash
# The masters' bf16 compute copies on the CPU, A/B in one invocation: the
# GPT-2 small bf16 step (batch 4, context 64, AdamW with clipping) with the
# copies (the default: AdamW writes them, the gathers send them) and
# without (--compute-copy=false: every gather casts its master), on 1 rank x
# 2 threads and on 2 ranks x 1 thread (full_shard, per-block units).
# Interleaved: each round runs every configuration once, the order rotating;
# the figures are medians over rounds of each run's median step (steps 2..)
# and of its CPU seconds (user + system, /usr/bin/time), which a shared
# host's load moves far less than wall time.
# Usage: tools/dev/bench_compute_copy.sh [steps] [rounds]   (from the repo root, after building)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-6}
ROUNDS=${2:-3}
source tools/dev/bench_lib.sh
common=(--preset=small --dtype=bf16 --batch=4 --ctx=64 --steps="$STEPS" --eval-every=0 --sample=0 --log-every=1
        --warmup=1)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

names=(one_copy one_cast two_copy two_cast)
declare -A label=(
  [one_copy]="1 rank x 2 threads, compute copies"
  [one_cast]="1 rank x 2 threads, cast at each gather"
  [two_copy]="2 ranks x 1 thread, compute copies"
  [two_cast]="2 ranks x 1 thread, cast at each gather"
)
run_one() {   # name round
  local name=$1 log=$out/$1.$2.log
  case $name in
    one_copy) /usr/bin/time -v env FSDP_NUM_THREADS=2 $LAUNCHER recipes/gpt2.lua "${common[@]}" ;;
    one_cast) /usr/bin/time -v env FSDP_NUM_THREADS=2 $LAUNCHER recipes/gpt2.lua "${common[@]}" --compute-copy=false ;;
    two_copy) /usr/bin/time -v env FSDP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "${MPIRUN[@]}" -np 2 \
                $LAUNCHER recipes/gpt2.lua "${common[@]}" ;;
    two_cast) /usr/bin/time -v env FSDP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "${MPIRUN[@]}" -np 2 \
                $LAUNCHER recipes/gpt2.lua "${common[@]}" --compute-copy=false ;;
  esac > "$log" 2>&1 || { cat "$log"; exit 1; }
  local ms cpu
  ms=$(median_ms < "$log")
  cpu=$(cpu_s < "$log")
  echo "$ms $cpu" >> "$out/$name"
  printf '  round %d  %-40s %9s ms/step  %7s CPU s  (load %s)\n' "$2" "${label[$name]}" "$ms" "$cpu" \
    "$(cut -d' ' -f1 /proc/loadavg)"
}

bench_rounds "$ROUNDS" "$STEPS" "${names[@]}"
echo "== medians over rounds"
for name in "${names[@]}"; do
  printf '  %-40s %9s ms/step  %7s CPU s\n' "${label[$name]}" "$(cut -d' ' -f1 "$out/$name" | median_of)" \
    "$(cut -d' ' -f2 "$out/$name" | median_of)"
done
