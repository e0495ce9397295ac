#!/usr/bin/env bash
# bench_agreement.sh REF_LAUNCHER NEW_LAUNCHER [PAIRS] [STEPS]: the cost of
# the always-on collective agreement on GPT-2 small, 2 ranks (full_shard,
# one unit per block, f32, batch 4 x 64), under mpirun. REF is a launcher
# built without the agreement, NEW one with it; runs alternate (REF, NEW,
# REF, NEW, ...) so both see the same load, and each run reports the median
# ms/step over steps 2..STEPS of rank 0's log. Prints every run, then the
# median of each side and their ratio.
set -euo pipefail
ref=$1 new=$2 pairs=${3:-4} steps=${4:-8}
cd "$(dirname "$0")/../.."
mpi=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader -np 2)
args=(recipes/gpt2.lua --preset=small --batch=4 --ctx=64 --steps="$steps" --eval-every=0 --sample=0 --log-every=1
      --warmup=1)
median() { sort -n | awk '{ a[NR] = $1 } END { print (NR ? a[int((NR + 1) / 2)] : "nan") }'; }
run() {   # launcher -> median ms/step of steps 2..
  env OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1 "${mpi[@]}" "$1" "${args[@]}" 2>&1 |
    grep -E '^step +[0-9]+(/[0-9]+)? \|' | awk -F'|' 'NR > 1 { sub(/ ms\/step/, "", $5); print $5 + 0 }' | median
}
a=() b=()
for i in $(seq "$pairs"); do
  x=$(run "$ref"); y=$(run "$new")
  a+=("$x"); b+=("$y")
  echo "pair $i: ref $x ms/step, agreement $y ms/step"
done
ma=$(printf '%s\n' "${a[@]}" | median) mb=$(printf '%s\n' "${b[@]}" | median)
echo "median: ref $ma ms/step, agreement $mb ms/step, ratio $(awk -v a="$ma" -v b="$mb" 'BEGIN { printf "%.4f", b / a }')"
