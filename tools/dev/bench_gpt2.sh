#!/usr/bin/env bash
# GPT-2 training step benchmarks, every run side by side with its reference
# in one invocation, interleaved: each round runs every configuration once,
# in turn, and the figure is the median over rounds of each run's median
# step (steps 2..). The host may be shared, so drift and other load hit
# every configuration alike.
#   engine vs PyTorch (tools/dev/gpt2_torch.py --bench), one process, 2 threads,
#   the small preset (GPT-2 124M), batch 4, context 64, AdamW with clipping:
#     engine f32, engine bf16 compute, PyTorch f32, PyTorch bf16 autocast;
#   FSDP: 2 ranks x 1 thread (full_shard, per-block units) vs 1 rank x 2
#     threads (the engine f32 run), the same global batch, f32.
# Each run also gives its CPU seconds (user + system, /usr/bin/time) and, for
# the engine, the matmuls' share of its steps (FSDP_MATMUL_STATS: the wall
# time inside matmul calls over the sum of the steps' times, all steps, the
# first included; FSDP_PEAK_TFLOPS skips the MFU calibration's matmuls).
# Usage: tools/dev/bench_gpt2.sh [steps] [rounds]   (from the repo root, after building)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-6}
ROUNDS=${2:-3}
source tools/dev/bench_lib.sh
common=(--batch=4 --ctx=64 --steps="$STEPS" --eval-every=0 --sample=0 --log-every=1 --warmup=1)
# per-product matmul statistics at exit; a stated peak instead of the MFU
# calibration (whose matmuls would count as the steps')
stats=(FSDP_MATMUL_STATS=1 FSDP_PEAK_TFLOPS=1)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# matmul share (%) of the steps: matmul ms (averaged over ranks) / sum of step ms
matmul_share() { awk -F'|' '/^step +[0-9]+(\/[0-9]+)? \|/ { sub(/ ms\/step/, "", $5); steps += $5 }
  /^matmul total:/ { split($0, w, " "); mm += w[3]; nr++ }
  END { if (nr == 0 || steps == 0) print "nan"; else printf "%.0f", 100 * mm / nr / steps }'; }
pct() { if [[ $1 == - || $1 == nan ]]; then echo "-"; else echo "$1%"; fi; }

names=(engine_f32 engine_bf16 torch_f32 torch_bf16 fsdp_2x1)
declare -A label=(
  [engine_f32]="engine, small, f32 (also FSDP's 1 rank x 2 threads)"
  [engine_bf16]="engine, small, bf16 compute"
  [torch_f32]="PyTorch, small, f32"
  [torch_bf16]="PyTorch, small, bf16 autocast"
  [fsdp_2x1]="FSDP: 2 ranks x 1 thread, full_shard, f32"
)
run_one() {   # name round -> appends "ms rss" to $out/name
  local name=$1 log=$out/$1.$2.log ms share
  # PyTorch gets the OpenMP wait policy the engine uses by default (workers
  # sleep when idle), which on a shared host is its faster setting
  local torch=(env OMP_WAIT_POLICY=PASSIVE /usr/bin/python3 tools/dev/gpt2_torch.py --bench --preset small --batch 4 --ctx 64 --threads 2
               --steps "$((STEPS - 1))")
  case $name in
    engine_f32)  /usr/bin/time -v env "${stats[@]}" FSDP_NUM_THREADS=2 $LAUNCHER recipes/gpt2.lua --preset=small "${common[@]}" ;;
    engine_bf16) /usr/bin/time -v env "${stats[@]}" FSDP_NUM_THREADS=2 $LAUNCHER recipes/gpt2.lua --preset=small --dtype=bf16 \
                   "${common[@]}" ;;
    torch_f32)   /usr/bin/time -v "${torch[@]}" ;;
    torch_bf16)  /usr/bin/time -v "${torch[@]}" --dtype bf16 ;;
    fsdp_2x1)    /usr/bin/time -v env "${stats[@]}" FSDP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "${MPIRUN[@]}" -np 2 \
                   $LAUNCHER recipes/gpt2.lua --preset=small "${common[@]}" ;;
  esac > "$log" 2>&1 || { cat "$log"; exit 1; }
  if [[ $name == torch_* ]]; then
    ms=$(grep '^torch:' "$log" | sed 's/.*ms_per_step=\([0-9.]*\).*/\1/')
    share=-
  else
    ms=$(median_ms < "$log")
    share=$(matmul_share < "$log")
  fi
  echo "$ms $(peak_rss_mb < "$log") $(cpu_s < "$log") $share" >> "$out/$name"
  printf '  round %d  %-44s %9s ms/step  %7s CPU s  matmuls %4s  (load %s)\n' "$2" "${label[$name]}" "$ms" \
    "$(cpu_s < "$log")" "$(pct "$share")" "$(cut -d' ' -f1 /proc/loadavg)"
}

echo "== machine: $(lscpu | grep 'Model name' | sed 's/ *Model name: *//'), $(nproc) cores," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg)"
bench_rounds "$ROUNDS" "$STEPS" "${names[@]}"

med() { cut -d' ' -f1 "$out/$1" | median_of; }
col_med() { cut -d' ' -f"$2" "$out/$1" | median_of; }
echo "== medians over rounds (ms/step, CPU seconds per run, matmul share of the steps; peak RSS of the last round)"
for n in "${names[@]}"; do
  printf '%-44s %9s ms/step  %6s CPU s  matmuls %4s  peak RSS %6s MB  (rounds: %s)\n' "${label[$n]}" "$(med "$n")" \
    "$(col_med "$n" 3)" "$(pct "$(col_med "$n" 4)")" "$(tail -1 "$out/$n" | cut -d' ' -f2)" \
    "$(cut -d' ' -f1 "$out/$n" | tr '\n' ' ')"
done
ratio() { awk -v a="$(med "$1")" -v b="$(med "$2")" 'BEGIN { printf "%.2f", a / b }'; }
verdict() { awk -v r="$1" -v t="$2" 'BEGIN { print (r <= t ? "met" : "NOT met") }'; }
target() {   # label a b bound
  local r
  r=$(ratio "$2" "$3")
  printf '%-46s %5s   (target <= %s: %s)\n' "$1" "$r" "$4" "$(verdict "$r" "$4")"
}
echo "== targets (ratios of the medians above)"
target "engine bf16 / PyTorch bf16 autocast:" engine_bf16 torch_bf16 0.60
target "engine f32 / PyTorch f32:" engine_f32 torch_f32 0.50
target "FSDP 2 ranks x 1 thread / 1 rank x 2 threads:" fsdp_2x1 engine_f32 1.10
# CPU seconds per run (all steps, start-up included): a busy-waiting rank or
# thread shows here even when a loaded host hides it in the wall time
cpu_med() { cut -d' ' -f3 "$out/$1" | median_of; }
echo "== CPU seconds per run, medians (the FSDP pair: $(cpu_med fsdp_2x1) vs $(cpu_med engine_f32))"
