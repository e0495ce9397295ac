#!/usr/bin/env bash
# GPT-2 training step benchmarks, each side by side with its reference in
# one run:
#   1. engine vs PyTorch (tools/gpt2_torch.py), one process, 2 threads:
#      the small preset (GPT-2 124M), batch 4, context 64, f32, AdamW;
#      also the engine alone on the tiny preset and with bf16 compute.
#   2. FSDP: 2 ranks x 1 thread (full_shard, per-block units) vs 1 rank x
#      2 threads, same global batch.
# Usage: tools/bench_gpt2.sh [steps]   (run from the repo root after building)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-6}
LAUNCHER=build/fsdp-lua
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader)
common=(--batch=4 --ctx=64 --steps="$STEPS" --eval-every=0 --sample=0 --log-every=1 --warmup=1)

# median ms/step over steps 2.. of a recipe log
median_ms() { grep -E '^step +[0-9]+ \|' | awk -F'|' 'NR > 1 { sub(/ ms\/step/, "", $5); print $5 + 0 }' |
  sort -n | awk '{ a[NR] = $1 } END { if (NR == 0) print "nan"; else print a[int((NR + 1) / 2)] }'; }
peak_rss_mb() { grep 'Maximum resident' | awk '{ printf "%.0f", $6 / 1024 }'; }

run_engine() {   # label, env..., -- args...
  local label=$1; shift
  local log; log=$(mktemp)
  /usr/bin/time -v "$@" > "$log" 2>&1 || { cat "$log"; exit 1; }
  printf '%-44s %9s ms/step  peak RSS %6s MB\n' "$label" "$(median_ms < "$log")" "$(peak_rss_mb < "$log")"
  grep -E 'peak MiB' "$log" | tail -1 | sed 's/^ */    /' || true
  rm -f "$log"
}

echo "== machine: $(lscpu | grep 'Model name' | sed 's/ *Model name: *//'), $(nproc) cores"
echo "== 1. engine vs PyTorch, 2 threads, batch 4 x 64, $STEPS steps (median of steps 2..)"
run_engine "engine small f32" env FSDP_NUM_THREADS=2 $LAUNCHER recipes/gpt2.lua --preset=small "${common[@]}"
run_engine "engine small bf16 compute" env FSDP_NUM_THREADS=2 $LAUNCHER recipes/gpt2.lua --preset=small --dtype=bf16 "${common[@]}"
torch_log=$(mktemp)
/usr/bin/python3 tools/gpt2_torch.py --bench --preset small --batch 4 --ctx 64 --threads 2 --steps "$((STEPS - 1))" > "$torch_log" 2>&1
grep '^torch:' "$torch_log"
rm -f "$torch_log"
run_engine "engine tiny f32 (ctx 64)" env FSDP_NUM_THREADS=2 $LAUNCHER recipes/gpt2.lua --preset=tiny "${common[@]}"

echo "== 2. FSDP small: 2 ranks x 1 thread vs 1 rank x 2 threads, global batch 4 x 64"
run_engine "1 rank, 2 threads, unsharded" env FSDP_NUM_THREADS=2 $LAUNCHER recipes/gpt2.lua --preset=small "${common[@]}"
run_engine "2 ranks, 1 thread each, full_shard" env FSDP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  "${MPIRUN[@]}" -np 2 $LAUNCHER recipes/gpt2.lua --preset=small "${common[@]}"
run_engine "2 ranks, 1 thread each, full_shard, fwd prefetch" env FSDP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
  "${MPIRUN[@]}" -np 2 $LAUNCHER recipes/gpt2.lua --preset=small --forward-prefetch "${common[@]}"
