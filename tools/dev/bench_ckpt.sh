#!/bin/bash
# bench_ckpt.sh: sharded checkpoint save/load throughput for GPT-2 small
# (124M, full_shard, 2 ranks) next to the raw write speed of the same disk
# (dd if=/dev/zero ... conv=fsync), measured in the same run: standalone
# before and after, and between the checkpoint repetitions for the same
# byte count (tools/dev/bench_ckpt.lua). Results go in docs/performance.md, "Checkpoints".
#   tools/dev/bench_ckpt.sh                      # build/, 5 repetitions, 2 ranks
#   BUILD=build REPS=3 NP=2 DIR=/mnt/fast/bench tools/dev/bench_ckpt.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
DIR=${DIR:-$BUILD/bench_ckpt}
REPS=${REPS:-5}
NP=${NP:-2}
PRESET=${PRESET:-small}
export FSDP_NUM_THREADS=${FSDP_NUM_THREADS:-1} OPENBLAS_NUM_THREADS=1
[ -x "$BUILD/fsdp-lua" ] || { echo "bench_ckpt.sh: build first ($BUILD/fsdp-lua is missing)" >&2; exit 1; }
mkdir -p "$DIR"
MIB=1425   # about the checkpoint's size (1.49 GB)

raw() {
  sync
  dd if=/dev/zero of="$DIR/dd.bin" bs=1M count=$MIB conv=fsync 2>&1 | tail -1
  rm -f "$DIR/dd.bin"
  sync
}

echo "== $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores; $(df -h "$DIR" | awk 'NR==2 {print $1 " (" $2 ")"}')"
echo "== raw disk before: dd if=/dev/zero bs=1M count=$MIB conv=fsync"
raw
echo "== checkpoints: $NP ranks, $REPS repetitions (median; each run listed)"
mpirun --allow-run-as-root --oversubscribe --mca btl self,vader -np "$NP" "$BUILD/fsdp-lua" tools/dev/bench_ckpt.lua \
  --dir="$DIR/run" --reps="$REPS" --preset="$PRESET"
echo "== raw disk after"
raw
rm -rf "$DIR"
