# bench_lib.sh: what the A/B benchmark scripts share (sourced from the repo
# root by tools/dev/bench_gpt2.sh and tools/dev/bench_compute_copy.sh): the medians,
# the CPU seconds of a run, and the interleaved rounds. Every configuration
# runs once per round, the order rotating each round, so a shared host's
# drift and load hit every configuration alike; the figures are medians over
# rounds.

LAUNCHER=build/fsdp-lua
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl self,vader)

# the median of the numbers on stdin, one a line ("nan" when none)
median_of() { sort -n | awk '{ a[NR] = $1 } END { if (NR == 0) print "nan"; else print a[int((NR + 1) / 2)] }'; }
# median ms/step over steps 2.. of a recipe log (the first step warms up)
median_ms() { grep -E '^step +[0-9]+(/[0-9]+)? \|' | awk -F'|' 'NR > 1 { sub(/ ms\/step/, "", $5); print $5 + 0 }' | median_of; }
# CPU seconds of the whole run (user + system, every process and thread) from /usr/bin/time -v
cpu_s() { awk -F': ' '/User time|System time/ { s += $2 } END { printf "%.1f", s }'; }
# peak resident set in MB from /usr/bin/time -v
peak_rss_mb() { grep 'Maximum resident' | awk '{ printf "%.0f", $6 / 1024 }'; }

# bench_rounds ROUNDS STEPS NAME...: runs `run_one NAME ROUND` (the caller's)
# for every name in every round, the order rotating
bench_rounds() {
  local rounds=$1 steps=$2 r i
  shift 2
  local names=("$@")
  echo "== $rounds rounds x ${#names[@]} runs, interleaved (the order rotates each round), $steps steps each"
  for ((r = 1; r <= rounds; r++)); do
    for ((i = 0; i < ${#names[@]}; i++)); do
      run_one "${names[$(((i + r - 1) % ${#names[@]}))]}" "$r"
    done
  done
}
