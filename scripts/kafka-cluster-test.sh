#!/usr/bin/env bash
# Runs the Kafka cluster test: three KRaft brokers on loopback (ports
# 47001-47003, controllers 47011-47013, from the Kafka jars scripts/services.sh
# fetched), a topic with replication factor 3 and min.insync.replicas 2, the
# group coordinator SIGKILLed while a kafkainbox consumer and a producer (then
# the outbox relay) run: every event has its effect exactly once. The test
# starts and stops the cluster itself; Postgres comes from the test services
# (`make services-up`).
#
# Usage: scripts/kafka-cluster-test.sh
# Environment: GO (default go).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GO=${GO:-go}
log() { printf '[kafka-cluster] %s\n' "$*" >&2; }

# The cluster's ports lie in Linux's default ephemeral range: reserve them
# while the test runs, so that no client connection takes one (restored after).
RES=/proc/sys/net/ipv4/ip_local_reserved_ports
RESERVED=
if [[ -w $RES && -z $(cat "$RES") ]] && echo 47000-47099 >"$RES" 2>/dev/null; then
  RESERVED=1
  log "reserved ports 47000-47099 from ephemeral use while the test runs"
fi
restore() {
  local rc=$?
  if [[ -n $RESERVED ]]; then echo >"$RES" 2>/dev/null || true; fi
  exit "$rc"
}
trap restore EXIT

t0=$SECONDS
$GO vet -tags kafkacluster ./kafkainbox
$GO test -tags kafkacluster -race -count=1 -timeout 10m -run '^TestCluster' -v ./kafkainbox
log "done in $((SECONDS - t0))s"
