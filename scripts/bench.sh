#!/usr/bin/env bash
# Runs every benchmark of the project, one `go test` process per area, and
# prints one table of the ratios each benchmark measured against its
# baseline in the same run, plus the raw throughput and latency metrics.
# Environment: BENCHTIME (default 1x: each benchmark sizes its own rounds),
# JUSTONCE_BENCH_ROWS (10000000) and JUSTONCE_BENCH_EXPIRED (1000000) for the
# scale benchmarks. Full logs go to bench.out.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BENCHTIME=${BENCHTIME:-1x}
areas=(./inbox ./httpbridge ./kafkainbox ./natsinbox)
: > bench.out
for a in "${areas[@]}"; do
  echo "== $a" | tee -a bench.out >&2
  go test -run '^$' -bench . -benchtime "$BENCHTIME" -timeout 60m "$a" 2>&1 | tee -a bench.out >&2
done
echo
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -sr); go: $(go version | cut -d' ' -f3)"
printf '%-62s %-22s %s\n' "benchmark" "metric" "value"
awk '/^Benchmark/ {
  name=$1; sub(/-[0-9]+$/, "", name)
  for (i = 3; i < NF; i += 2) {
    v=$i; m=$(i+1)
    if (m ~ /ratio|\/|vs|×|p99|ops\/s|ev\/s/) printf "%-62s %-22s %s\n", name, m, v
  }
}' bench.out
