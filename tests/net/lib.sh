# Shared by tests/net/test_*.sh: bash test_X.sh LAUNCHER SOURCE_DIR.
# Each test skips (exit 77, with netcluster's one-line reason) where network
# namespaces cannot be made, counts its checks and fails when one fails.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/../sh/lib.sh" "$@"   # L, ROOT, TMP, ok/bad, finish
SRC=$ROOT
NC="$SRC/tools/netcluster"
export OPENBLAS_NUM_THREADS=1 FSDP_NUM_THREADS=1
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader -np)

probe=$("$NC" run --nodes=1 -- true 2>&1); rc=$?
if [ $rc -eq 77 ]; then echo "SKIP: $probe"; exit 77; fi
[ $rc -eq 0 ] || { echo "FAIL: netcluster cannot run 'true' on one node (exit $rc): $probe"; exit 1; }

# Whatever happens, no run of ours is left: netcluster tears down its own, and
# `clean` removes those of runs this test killed.
trap 'rm -rf "$TMP"; "$NC" clean' EXIT

# Nothing of run P is left: no namespace, bridge, link end, hosts file.
left_of() {
  local p=$1
  { ip netns list | awk '{print $1}' | grep "^netcl-$p-"
    ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^nc(b${p}[dc]|${p}[dc][0-9]+)$"
    ls -d /etc/netns/netcl-"$p"-* /tmp/netcl-"$p" 2>/dev/null; } | tr '\n' ' '
}

# step loss grad_norm at full precision from a --metrics file
losses_of() { sed -nE 's/.*"grad_norm":([^,]*),.*"loss":([^,]*),.*"step":([0-9]+),.*/\3 \2 \1/p' "$1"; }
