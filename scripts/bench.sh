#!/usr/bin/env bash
# Runs the project's benchmarks, one `go test` process per area, and prints
# one table of what each measured: ratios against a baseline measured in the
# same run (interleaved with it, in a fixed number of rounds), plus the raw
# throughput and latency metrics. Every benchmark sizes its own work: the
# numbers do not depend on -benchtime, which stays 1x.
#
# Environment:
#   JUSTONCE_BENCH_SMALL=1  a few short rounds of every benchmark, so that CI
#                           runs them all and they cannot rot (numbers not
#                           meant to be read): about a minute or two.
#   JUSTONCE_BENCH_SCALE=1  the scale benchmarks at full size: a 10 million
#                           row ledger, 1 million expired rows for the janitor,
#                           the simulated week of retention and the claims in
#                           steady retention (adds tens of minutes). Default:
#                           1 million / 200,000 rows, neither of those.
#   JUSTONCE_BENCH_ROWS, JUSTONCE_BENCH_EXPIRED  override those sizes.
#   BENCH_AREAS             space-separated packages (default: all below that exist).
#   BENCH                   -bench regexp (default: .).
# Full logs go to bench.out. A default run takes about 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

skip='^$'
if [[ ${JUSTONCE_BENCH_SMALL:-} == 1 ]]; then
  export JUSTONCE_BENCH_ROWS=${JUSTONCE_BENCH_ROWS:-20000}
  export JUSTONCE_BENCH_EXPIRED=${JUSTONCE_BENCH_EXPIRED:-20000}
  export JUSTONCE_BENCH_DAY_S=${JUSTONCE_BENCH_DAY_S:-4} # short days; the bucket width rounds to whole seconds
  export JUSTONCE_BENCH_RATE=${JUSTONCE_BENCH_RATE:-100}
elif [[ ${JUSTONCE_BENCH_SCALE:-} == 1 ]]; then
  export JUSTONCE_BENCH_ROWS=${JUSTONCE_BENCH_ROWS:-10000000}
  export JUSTONCE_BENCH_EXPIRED=${JUSTONCE_BENCH_EXPIRED:-1000000}
else
  export JUSTONCE_BENCH_ROWS=${JUSTONCE_BENCH_ROWS:-1000000}
  export JUSTONCE_BENCH_EXPIRED=${JUSTONCE_BENCH_EXPIRED:-200000}
  # A simulated week, and claims in steady retention (6 minutes):
  # JUSTONCE_BENCH_SCALE=1.
  skip='^(BenchmarkRetentionWeek|BenchmarkClaimSteadyState)$'
fi

if [[ -n ${BENCH_AREAS:-} ]]; then
  read -r -a wanted <<<"$BENCH_AREAS"
else
  wanted=(./inbox ./httpbridge ./grpcbridge ./outbox ./transports/kafkainbox ./transports/natsinbox)
fi
areas=()
for a in "${wanted[@]}"; do
  if [[ -d $a ]] && compgen -G "$a/*_test.go" >/dev/null; then
    areas+=("$a")
  else
    echo "== $a: no such package, skipped" >&2
  fi
done

: >bench.out
status=0
for a in "${areas[@]}"; do
  echo "== $a" | tee -a bench.out >&2
  if ! go test -run '^$' -bench "${BENCH:-.}" -skip "$skip" -benchtime 1x -timeout 60m "$a" 2>&1 | tee -a bench.out >&2; then
    status=1
  fi
done

echo
echo "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB, $(uname -sr); go: $(go version | cut -d' ' -f3); load: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-62s %-26s %s\n' "benchmark" "metric" "value"
awk '/^Benchmark/ {
  name=$1; sub(/-[0-9]+$/, "", name)
  for (i = 3; i < NF; i += 2) {
    v=$i; m=$(i+1)
    if (m ~ /ratio|\/|vs|×|p99|p50|ops\/s|ev\/s|rows/) printf "%-62s %-26s %s\n", name, m, v
  }
}' bench.out
if ((status != 0)); then
  echo "some benchmarks failed: see bench.out" >&2
fi
exit $status
