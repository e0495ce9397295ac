#!/usr/bin/env bash
# Runs test_ckpt_node_local.lua on 2 ranks where rank 1 has a filesystem of
# its own over the save folder (a tmpfs in a private mount namespace, as a
# node-local disk), with a leftover step_00000002.tmp of a killed save on
# it. Exit 77 (skipped) where mount namespaces are not allowed.
#   bash ckpt_node_local.sh MPIRUN... -- LAUNCHER DIR
set -u
mpirun=()
while [ "$1" != "--" ]; do mpirun+=("$1"); shift; done
shift
L=${1:?usage: ckpt_node_local.sh MPIRUN... -- LAUNCHER DIR}
D=${2:?usage: ckpt_node_local.sh MPIRUN... -- LAUNCHER DIR}
if ! unshare -m sh -c "mount -t tmpfs none /mnt 2>/dev/null || mount -t tmpfs none /tmp" 2>/dev/null; then
  echo "ckpt_node_local: skipped: no mount namespaces here"; exit 77
fi
rm -rf "$D" && mkdir -p "$D/ckpt"
T=tests/distributed/test_ckpt_node_local.lua
local_disk="mount -t tmpfs none '$D/ckpt' && mkdir -p '$D/ckpt/step_00000002.tmp' &&
  echo stale > '$D/ckpt/step_00000002.tmp/.save_token' && exec '$L' $T --dir='$D'"
"${mpirun[@]}" 1 "$L" $T --dir="$D" : -np 1 unshare -m sh -c "$local_disk"
