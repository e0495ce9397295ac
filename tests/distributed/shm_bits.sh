#!/usr/bin/env bash
# The one-host collectives through shared memory against MPI's, bit for bit:
# test_fsdp_shm.lua runs twice on NP ranks with the given options, once with
# FSDP_COMM_SHM=1 (it checks that the gathers and reduce-scatters went
# through shared memory) and once with FSDP_COMM_SHM=0 (none did); the
# losses and final parameters the two runs write must be the same bytes.
#   bash shm_bits.sh MPIRUN... -- LAUNCHER NP [OPTIONS...]
set -u
mpirun=()
while [ "$1" != "--" ]; do mpirun+=("$1"); shift; done
shift
L=${1:?usage: shm_bits.sh MPIRUN... -- LAUNCHER NP [OPTIONS...]} np=${2:?}
shift 2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
script=tests/distributed/test_fsdp_shm.lua
FSDP_COMM_SHM=1 "${mpirun[@]}" "$np" -x FSDP_COMM_SHM "$L" $script --expect=shm --out="$out/shm.txt" "$@" ||
  { echo "FAIL: the shared-memory run failed"; exit 1; }
FSDP_COMM_SHM=0 "${mpirun[@]}" "$np" -x FSDP_COMM_SHM "$L" $script --expect=mpi --out="$out/mpi.txt" "$@" ||
  { echo "FAIL: the MPI run failed"; exit 1; }
if ! cmp "$out/shm.txt" "$out/mpi.txt"; then
  echo "FAIL: losses or parameters differ between the two paths"
  diff "$out/shm.txt" "$out/mpi.txt" | head -c 2000
  exit 1
fi
echo "ok: $(wc -l < "$out/shm.txt") lines of losses and parameters, the same bits through shared memory and MPI"
