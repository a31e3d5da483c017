#!/usr/bin/env bash
# Runs the project's benchmarks, one `go test` process per area, and writes
# and prints one table per area of what each measured: ratios against a
# baseline measured in the same run (interleaved with it, in a fixed number
# of rounds), next to the raw throughput and latency metrics. Every benchmark
# sizes its own work: the numbers do not depend on -benchtime, which stays 1x.
#
# The tables go to a results file (harness/benchresults formats it), with a
# header that says where the numbers come from: date, commit (and whether the
# tree was dirty), machine, load average at the start and the end, Go version,
# command and environment knobs. A default run writes docs/results/bench.md,
# JUSTONCE_BENCH_SCALE=1 docs/results/bench-scale.md (both meant to be
# committed, and included by the documentation); any other run (the small
# sizes, a subset, other sizes) writes bench-draft.md at the repository root,
# which git ignores, marked as not meant to be read.
#
# Environment:
#   JUSTONCE_BENCH_SMALL=1  a few short rounds of every benchmark, so that CI
#                           runs them all and they cannot rot (numbers not
#                           meant to be read): about a minute or two.
#   JUSTONCE_BENCH_SCALE=1  the scale benchmarks at full size: a 10 million
#                           row ledger (BenchmarkLedgerAtScale runs rows=10M
#                           beside rows=1M; the layouts' comparisons fill 10
#                           million rows), 1 million expired rows for the
#                           janitor, the simulated week of retention and the
#                           claims in steady retention (adds tens of
#                           minutes). Default: 1 million / 200,000 rows,
#                           neither of those.
#   JUSTONCE_BENCH_ROWS, JUSTONCE_BENCH_EXPIRED  override those sizes (ROWS:
#                           the layouts' comparisons; BenchmarkLedgerAtScale
#                           keeps its 1M and 10M).
#   BENCH_AREAS             space-separated packages (default: all below that exist).
#   BENCH                   -bench regexp (default: .).
#   BENCH_ROUNDS            run the whole set this many times (default 1); the
#                           results give each value's median and its range
#                           (min-max) over the rounds.
#   BENCH_RESULTS           write the results file here instead.
#   BENCH_COMMAND           the command to name in the results (make bench sets it).
# Full logs go to bench.out. A default run takes about 13 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

rounds=${BENCH_ROUNDS:-1}
if ! [[ $rounds =~ ^[1-9][0-9]*$ ]]; then
  echo "BENCH_ROUNDS must be a positive integer, not '$rounds'" >&2
  exit 2
fi

# The results' formatter, built first (so that a broken one fails before the
# run, not after it); `start` records the run's beginning and reads the knobs
# as the caller set them, before the defaults below.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
go build -o "$tmp/benchresults" ./harness/benchresults/cmd/benchresults
"$tmp/benchresults" start -root . -state "$tmp/run.json" -command "${BENCH_COMMAND:-bash scripts/bench.sh}"

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
for ((r = 1; r <= rounds; r++)); do
  for a in "${areas[@]}"; do
    # The marker line names the area, the round and the exact command:
    # harness/benchresults reads them.
    echo "== $a (round $r of $rounds): go test -run '^\$' -bench '${BENCH:-.}' -skip '$skip' -benchtime 1x -timeout 60m $a" | tee -a bench.out >&2
    if ! go test -run '^$' -bench "${BENCH:-.}" -skip "$skip" -benchtime 1x -timeout 60m "$a" 2>&1 | tee -a bench.out >&2; then
      status=1
    fi
  done
done

echo
if ! "$tmp/benchresults" write -state "$tmp/run.json" -log bench.out; then
  status=1
fi
if ((status != 0)); then
  echo "some benchmarks failed: see bench.out" >&2
fi
exit $status
