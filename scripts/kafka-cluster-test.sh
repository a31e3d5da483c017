#!/usr/bin/env bash
# Runs the Kafka cluster test: three KRaft brokers on loopback (ports
# 27001-27003, controllers 27011-27013, from the Kafka jars scripts/services.sh
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

t0=$SECONDS
$GO vet -tags kafkacluster ./transports/kafkainbox
$GO test -tags kafkacluster -race -count=1 -timeout 10m -run '^TestCluster' -v ./transports/kafkainbox
log "done in $((SECONDS - t0))s"
