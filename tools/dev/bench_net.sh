#!/usr/bin/env bash
# tools/dev/bench_net.sh [ROUNDS] [STEPS]: FSDP over a network link. The same
# recipe on 2 ranks, on one host (shared memory) and on two nodes of
# tools/netcluster (TCP over a veth link shaped with tc), forward prefetch
# on (the default) and off; then hybrid_shard on 2 nodes x 2 ranks. Per
# configuration: the median over steps 3..STEPS (from --metrics) of the
# step, the comm busy time (a collective running), the exposed time (the
# compute waiting for one) and the share hidden, each the median over the
# rounds, which run interleaved. Names after STEPS pick configurations
# (default: all but the compressed and the one-lane ones). Needs root (network namespaces).
#   tools/dev/bench_net.sh 2 8
#   tools/dev/bench_net.sh 2 8 1gbit 1gbit_int8 100mbit 100mbit_int8
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
source tools/dev/bench_lib.sh
rounds=${1:-1}
steps=${2:-10}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export FSDP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# comm and compute of the same order on this host: 6 blocks of width 256 (4.8M parameters), 16 x 64 tokens
model="--layers=6 --width=256 --heads=8 --batch=16 --ctx=64"
recipe="recipes/gpt2.lua $model --steps=$steps --eval-every=0 --sample=0 --log-every=1000"
declare -A how=(
  [host]="mpirun"                [host_nofp]="mpirun --no-forward-prefetch"
  [unshaped]="net"               [10gbit]="net --rate=10gbit"
  [1gbit]="net --rate=1gbit"     [1gbit_nofp]="net --rate=1gbit --no-forward-prefetch"
  [100mbit]="net --rate=100mbit" [100mbit_nofp]="net --rate=100mbit --no-forward-prefetch"
  [hybrid_host]="mpirun4 --strategy=hybrid_shard --group-size=2"
  [hybrid_1gbit]="net4 --rate=1gbit --strategy=hybrid_shard --group-size=2"
  [1gbit_int8]="net --rate=1gbit --grad-compress=int8" [100mbit_int8]="net --rate=100mbit --grad-compress=int8"
  [hybrid_host_1lane]="mpirun4 FSDP_COMM_LANES=1 --strategy=hybrid_shard --group-size=2"
  [hybrid_1gbit_1lane]="net4 FSDP_COMM_LANES=1 --rate=1gbit --strategy=hybrid_shard --group-size=2"
)
names=(host host_nofp unshaped 10gbit 1gbit 1gbit_nofp 100mbit 100mbit_nofp hybrid_host hybrid_1gbit)
if [ $# -gt 2 ]; then names=("${@:3}"); fi
for n in "${names[@]}"; do [ -n "${how[$n]:-}" ] || { echo "bench_net.sh: no configuration '$n'" >&2; exit 2; }; done

run_one() {
  local name=$1 round=$2 words kind rate="" extra=() envs=() out="$work/$1.$2.jsonl"
  read -ra words <<<"${how[$name]}"
  kind=${words[0]}
  for w in "${words[@]:1}"; do
    if [[ $w == --rate=* ]]; then rate=$w
    elif [[ $w == [A-Z]*=* ]]; then envs+=("$w")
    else extra+=("$w"); fi
  done
  case $kind in
    mpirun) env "${envs[@]}" "${MPIRUN[@]}" -np 2 "$LAUNCHER" $recipe "${extra[@]}" --metrics="$out" ;;
    mpirun4) env "${envs[@]}" "${MPIRUN[@]}" -np 4 "$LAUNCHER" $recipe "${extra[@]}" --metrics="$out" ;;
    net) env "${envs[@]}" tools/netcluster run --nodes=2 --ranks-per-node=1 $rate -- "$LAUNCHER" $recipe "${extra[@]}" --metrics="$out" ;;
    net4) env "${envs[@]}" tools/netcluster run --nodes=2 --ranks-per-node=2 $rate -- "$LAUNCHER" $recipe "${extra[@]}" --metrics="$out" ;;
  esac > "$work/$name.$round.log" 2>&1 || { echo "$name: failed"; tail -5 "$work/$name.$round.log"; exit 1; }
}
bench_rounds "$rounds" "$steps" "${names[@]}"

# medians over steps 3.. of one run's records: step busy exposed, and the
# replica lane's busy exposed (ms; 0 without one)
figures() {
  "$LAUNCHER" -e "
    local json, cols = require 'fsdp.json', { {}, {}, {}, {}, {} }
    for l in io.lines('$1') do
      local r = json.decode(l)
      if r.type == 'step' and r.step >= 3 then
        for i, k in ipairs({ 'step_ms', 'comm_busy_ms', 'comm_exposed_ms', 'replica_busy_ms', 'replica_exposed_ms' }) do
          table.insert(cols[i], r[k] or 0)
        end
      end
    end
    local out = {}
    for i, c in ipairs(cols) do table.sort(c); out[i] = string.format('%.1f', c[math.floor((#c + 1) / 2)]) end
    print(table.concat(out, ' '))"
}
printf '%-20s %10s %10s %12s %8s %18s\n' config step_ms busy_ms exposed_ms hidden replica_busy/exp
for n in "${names[@]}"; do
  s=() b=() e=() rb=() re=()
  for ((r = 1; r <= rounds; r++)); do
    read -r a1 a2 a3 a4 a5 <<<"$(figures "$work/$n.$r.jsonl")"
    s+=("$a1") b+=("$a2") e+=("$a3") rb+=("$a4") re+=("$a5")
  done
  ms=$(printf '%s\n' "${s[@]}" | median_of) busy=$(printf '%s\n' "${b[@]}" | median_of)
  exp=$(printf '%s\n' "${e[@]}" | median_of)
  rbusy=$(printf '%s\n' "${rb[@]}" | median_of) rexp=$(printf '%s\n' "${re[@]}" | median_of)
  hid=$(awk -v b="$busy" -v e="$exp" 'BEGIN { h = b > 0 ? 1 - e / b : 0; if (h < 0) h = 0; printf "%.0f%%", 100 * h }')
  rep=$(awk -v b="$rbusy" -v e="$rexp" 'BEGIN { if (b > 0) printf "%.1f/%.1f", b, e; else printf "-" }')
  printf '%-20s %10s %10s %12s %8s %18s\n' "$n" "$ms" "$busy" "$exp" "$hid" "$rep"
done
