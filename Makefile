# justonce developer targets. Tests need real Postgres, Redis and Kafka:
# `make services-up` starts them on loopback (no Docker needed) and writes
# .services.env, which the tests read. NATS is embedded in the tests.

GO ?= go
# staticcheck 2026.2.2 == module version v0.8.2, the newest release, built for Go 1.26.
# (The year-style tag is not resolvable through the module proxy; pin the semver.)
STATICCHECK_VERSION ?= v0.8.2

.PHONY: all services-up services-down services-status test lint bench demo fuzz chaos chaos-short chaos-buckets chaos-failover soak generate

all: lint test

services-up:
	bash scripts/deps.sh
	bash scripts/services.sh up

services-down:
	bash scripts/services.sh down

services-status:
	bash scripts/services.sh status

# test: the root module, then the framework adapters' module (integrations/),
# which has its own go.mod so that the library does not depend on chi, echo
# or gin.
test: services-up
	$(GO) test -race -count=1 -timeout 20m ./...
	cd integrations && $(GO) test -race -count=1 -timeout 10m ./...

lint:
	@out="$$(gofmt -l .)"; if [ -n "$$out" ]; then echo "gofmt -l: these files need gofmt -w:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) vet -tags 'containers kafkacluster' ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...
	cd integrations && $(GO) vet ./... && $(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...
	cd bench/peers && $(GO) vet ./... && $(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

# failover: the failover proofs alone, verbose, so that the time each failover
# took to resume is printed (they also run in `make test`): Postgres with a
# streaming standby promoted (synchronous and asynchronous), Redis behind
# Sentinel, a three-node NATS JetStream cluster; each test starts its own
# servers on loopback (Postgres and Redis binaries as for services-up).
.PHONY: failover
failover: services-up
	$(GO) test -race -count=1 -v -timeout 15m ./harness/failover

# bench: every benchmark, each sizing its own work and measuring its baseline
# interleaved with it in the same run; prints the ratios (about 13 minutes).
# JUSTONCE_BENCH_SMALL=1: a few short rounds of each (CI); JUSTONCE_BENCH_SCALE=1:
# the 10-million-row sizes, the simulated retention week and the claims in steady
# retention; BENCH_ROUNDS=3: the whole set three times, each value's median and
# range. Writes docs/results/bench.md (bench-scale.md at scale; bench-draft.md,
# not for the docs, for the small sizes or a subset). See scripts/bench.sh.
bench: services-up
	BENCH_COMMAND='make bench' bash scripts/bench.sh
	$(GO) run ./harness/benchresults/cmd/benchresults include docs/performance.md

demo: services-up
	set -a && . ./.services.env && set +a && $(GO) run ./examples/payments

# fuzz: the fuzz targets of what parses untrusted input, 30 s each.
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzParseKey$$' -fuzztime 30s ./httpbridge
	$(GO) test -run '^$$' -fuzz '^FuzzCanonicalJSON$$' -fuzztime 30s ./internal/fingerprint
	$(GO) test -run '^$$' -fuzz '^FuzzParseKey$$' -fuzztime 30s ./grpcbridge
	$(GO) test -run '^$$' -fuzz '^FuzzParseFirstSent$$' -fuzztime 30s ./grpcbridge

# generate: regenerate the committed protobuf code of the gRPC test service
# (CI does not need protoc). Needs Debian's protobuf-compiler; the plugins are
# installed at pinned versions.
PROTOC_GEN_GO_VERSION ?= v1.36.12
PROTOC_GEN_GO_GRPC_VERSION ?= v1.6.2
generate:
	$(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	$(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	PATH="$$($(GO) env GOPATH)/bin:$$PATH" protoc -I harness/grpctest/testpb \
		--go_out=paths=source_relative:harness/grpctest/testpb \
		--go-grpc_out=paths=source_relative:harness/grpctest/testpb \
		harness/grpctest/testpb/orders.proto

# chaos: the full fault-injection run (100,000 events per transport, 20 % duplicates,
# >= 20 SIGKILLs of consumers, Postgres and Kafka crashes (SIGKILL + restart of the
# services started by services-up), NATS restarts, Redis outages, dropped Postgres
# connections, network faults through an in-process proxy, hostile handlers,
# operator releases, the janitor, HTTP retries), and two-hop pipelines through the
# outbox (Kafka -> A -> NATS -> B, HTTP -> A -> Kafka -> B) with relay processes
# SIGKILLed too, and two overloads (every handler held on the effects table for
# 3 s: the pools fill, the bridges shed, the clients retry); then the payment
# service in steps (examples/payments/stepspay) on every front, SIGKILLed at
# every point between and inside its steps (35 kills, 1,000 payments). The
# services are up at the end.
chaos: services-up
	$(GO) run ./harness/chaos -two-hop 20000 -two-hop-http-keys 1000 -relay-kills 6 -overloads 2 -steps-kills 35 -steps-payments 200

# chaos-short: the shorter run CI does: at least one fault of every kind.
chaos-short: services-up
	$(GO) run ./harness/chaos -events 5000 -kills 8 -redis-outages 2 -pg-terminates 3 -pg-crashes 1 \
		-kafka-crashes 1 -nats-restarts 1 -net-faults 3 -releases 2 -hostile-every 100 -http-keys 500 \
		-two-hop 2000 -two-hop-http-keys 300 -relay-kills 3 -steps-kills 7 -steps-payments 50 -timeout 9m

# chaos-buckets: the fault matrix on the time-bucket ledger layout, at a size CI
# runs: each key shard moves to a new bucket every 10 s, so buckets turn over and
# the workers' views of them go stale while consumers, Postgres, Kafka and Redis
# are killed around them.
chaos-buckets: services-up
	$(GO) run ./harness/chaos -layout buckets -bucket-width 10s -events 2000 -kills 6 -redis-outages 1 \
		-pg-terminates 2 -pg-crashes 1 -kafka-crashes 1 -nats-restarts 1 -net-faults 2 -releases 1 \
		-hostile-every 100 -http-keys 300 -two-hop 1000 -two-hop-http-keys 200 -relay-kills 2 -timeout 6m

# chaos-failover: the failovers, at a size CI runs. The run's Postgres is a
# primary with a synchronous streaming standby, the ledgers' Redis is behind
# Sentinel and NATS is a three-node JetStream cluster (streams with Replicas
# 3), all started by the run (harness/testsvc) and reached through
# multi-host connection strings, the Sentinel failover client and the
# cluster's URLs. Each fails over twice: the primary SIGKILLed and the
# standby promoted (the dead node rebuilt as the new standby), the master
# SIGKILLed and the replica promoted by the sentinels, the node leading the
# stream killed. The other faults run in their forms on these services (the
# primary crashed and restarted in place, the master restarted at once, a
# follower node restarted); the franz-go consumer and the gRPC bridge run too.
# The Kafka broker is not crashed here (chaos-short and chaos-buckets do).
chaos-failover: services-up
	$(GO) run ./harness/chaos -transports kafka,franz,nats,http,grpc -pg-failovers 2 -redis-failovers 2 -nats-leader-kills 2 \
		-events 2000 -kills 6 -redis-outages 1 -pg-terminates 2 -pg-crashes 1 -kafka-crashes 0 -nats-restarts 1 -net-faults 3 \
		-releases 1 -hostile-every 100 -http-keys 300 -grpc-keys 300 -two-hop 1000 -two-hop-http-keys 200 -relay-kills 2 -timeout 8m

# soak: a day's work in an hour, not in CI. Steady load on every front (Kafka
# through kafka-go and franz-go, NATS, HTTP, gRPC, the two pipelines through
# the outbox and its relays) on the services with a standby, one fault of a
# random kind every minute (every kind above, the failovers included), for
# SOAK_DURATION (default 1h; SOAK_DURATION=10m for a short one), then it
# drains and stops. Every minute it prints each process's live heap,
# goroutines, connections, file descriptors and log lines, Postgres's WAL and
# table sizes and each front's p99 latency; it fails on a leak (a measure
# rising steadily after the warm-up), a log storm, or an event lost or
# doubled. Writes docs/results/soak.md (soak-draft.md, not for the docs, for
# another duration). SOAK_FLAGS passes more flags (-soak-rate, -soak-*; see
# harness/chaos/soak.go). It takes the machine's two cores for its duration.
SOAK_DURATION ?= 1h
soak: services-up
	SOAK_COMMAND='make soak' $(GO) run ./harness/chaos -soak $(SOAK_DURATION) $(SOAK_FLAGS)

# fresh-machine: the README's `make demo` (then a short go test -race against the
# services it started; FRESH_TEST='make test' for the whole suite) on a bare
# Debian 12 root filesystem with only Go and make, under chroot in its own
# namespaces, services on ports that do not clash with services-up's. Needs root
# (sudo) and the network to Debian's, Maven's and Go's registries; about 15
# minutes the first time. Not run by CI (too long for its budget). See
# scripts/fresh-machine.sh.
.PHONY: fresh-machine
fresh-machine:
	bash scripts/fresh-machine.sh

# bench-peers: justonce's Kafka consumer (defaults) beside what a user would use
# instead (a hand-written inbox table, Watermill's Kafka subscriber and its
# transactional SQL subscriber, both with the Deduplicator middleware), on the
# same Kafka, Postgres and handler: events/s and the ratio against justonce in
# the same run, then one SIGKILL of each consumer mid-stream: effects lost and
# doubled. PEERS_EVENTS (default 20000; CI: 2000), PEERS_PARTITIONS (4),
# PEERS_ROUNDS (1). Writes docs/results/peers.md (peers-draft.md, not for the
# docs, below the default events or for a subset of the peers). The peers live
# in their own module, bench/peers.
.PHONY: bench-peers
bench-peers: services-up
	cd bench/peers && BENCH_COMMAND='make bench-peers' $(GO) run .
	$(GO) run ./harness/benchresults/cmd/benchresults include docs/performance.md
