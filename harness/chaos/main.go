// Command chaos tries hard to break justonce's exactly-once claim and
// checks, event by event, from the business table, the ledger and the
// dead-letter streams, that it held.
//
// It produces events with duplicates to a real Kafka topic (duplicates at
// later offsets) and a JetStream stream (duplicates republished after the
// stream's duplicate window), runs several consumer processes per transport
// (this same binary, in worker mode), and serves HTTP requests with
// Idempotency-Keys, several clients per key, through a real server. While
// it runs it injects, each fault kind a flag:
//
//   - consumer SIGKILLs (-kills): a worker dies mid-batch and is restarted;
//     the summary gives the time from each restart to its first effect;
//   - Redis outages (-redis-outages): a private redis-server stopped and
//     started;
//   - dropped Postgres connections (-pg-terminates): pg_terminate_backend;
//   - Postgres crashes (-pg-crashes): SIGKILL of the postmaster, then a
//     restart through scripts/services.sh (crash recovery);
//   - Kafka crashes (-kafka-crashes): SIGKILL of the broker, then a restart
//     through scripts/services.sh;
//   - NATS restarts (-nats-restarts): the embedded nats-server shut down
//     and started again on the same port and JetStream file store
//     (-nats-sync-always for sync_always; by default the store syncs every
//     2 minutes, and the restart is a graceful shutdown, which flushes it);
//   - network faults (-net-faults), through an in-process TCP fault proxy
//     (toxiproxy, on 127.0.0.1) that the consumers and the HTTP server use
//     to reach Postgres and Redis: connections reset at the server's next
//     reply (a COMMIT in flight is executed and its answer lost:
//     ErrCommitUnknown, counted), latency spikes, and stalled connections
//     closed after a timeout;
//   - hostile handlers (-hostile-every): every n-th event's handler
//     swallows a unique violation (the transaction rolls back at COMMIT),
//     adds a row that breaks a deferred constraint at COMMIT, panics, or
//     runs longer than the Redis lock TTL. Half of the failing kinds fail
//     on their first attempts only and must end with exactly one effect;
//     the others fail every time and must end dead-lettered (in the
//     dead-letter topic or stream) and recorded failed in the ledger;
//   - two-hop pipelines (-two-hop, -two-hop-http-keys): Kafka → A (inbox
//     and outbox.Add of one NATS message per event) → outbox relay →
//     JetStream → B (inbox, one effect per event), and HTTP clients
//     retrying with an Idempotency-Key → A (the HTTP bridge, the handler
//     adds one Kafka message; A runs a relay too) → Kafka → B. A, B and the
//     relays are child processes, SIGKILLed by -kills, and the relays by
//     -relay-kills too. The relays publish to Kafka with kafka-go, or with
//     franz-go under -kafka-publisher franz-go. The verdict is on B's
//     effects: one per unique source ID;
//   - the ledger layout (-layout buckets): the whole run on the time-bucket
//     layout (migrations.LayoutTimeBuckets);
//   - operator actions (-releases, -janitor): permanent failures are
//     "repaired", their keys released with Ledger.Release and the events
//     resent, so each must then run exactly once; and the janitor purges
//     short-lived rows of another scope during the run;
//   - failovers, each on a service with a standby the run starts itself
//     (harness/testsvc), off unless asked for. Postgres failovers
//     (-pg-failovers): the run's database is a primary with a synchronous
//     streaming standby, which every process reaches through a multi-host
//     connection string with target_session_attrs=read-write (through the
//     fault proxy, one proxy per node); the primary is SIGKILLed, the standby
//     promoted and the dead node rebuilt as the new standby; -pg-crashes then
//     SIGKILL the primary and restart it in place;
//   - Redis Sentinel failovers (-redis-failovers): the ledgers' Redis is a
//     master, a replica and three sentinels, reached through the Sentinel
//     failover client (and the fault proxy, one proxy per data node); the
//     master is SIGKILLed, the sentinels promote the replica, and the dead
//     node comes back as its replica; -redis-outages then kill the master and
//     restart it at once;
//   - NATS leader kills (-nats-leader-kills): NATS is a three-node JetStream
//     cluster embedded in this process, every stream with Replicas 3; the
//     node leading the stream is killed, a new leader elected, and the node
//     restarted on its file store; -nats-restarts then restart a node that
//     leads nothing;
//   - SIGKILLs of a payment service in steps (-steps-kills, -steps-payments),
//     once the run's other faults are over: the payments example's service
//     in steps (examples/payments/stepspay: an order row, a charge at a
//     provider behind the HTTP bridge, a receipt row) on HTTP, gRPC,
//     kafka-go, franz-go and NATS, each payment delivered twice, killed at
//     each point between and inside the steps in turn; every payment must
//     end with one order, one receipt and one charge;
//   - more fronts (-transports): franz (a franzinbox consumer group on a
//     topic of its own) and grpc (the gRPC bridge in child processes,
//     clients retrying with grpcretry and a key per call, -grpc-keys).
//
// The verdict: every event that must run has exactly one effect and a done
// ledger row (0 lost, 0 doubled), every permanent hostile event that was
// not released has no effect, a failed ledger row and a dead letter, every
// HTTP and gRPC key ran once and all its clients got the same response,
// every source event of a two-hop pipeline has exactly one effect at B
// (and the hop carries no message of a rolled-back run of A; the outbox is
// empty at the end), and every fault asked for was injected. It prints a
// summary with the count of each fault and exits 1 on any violation.
//
// With -soak DURATION the run is a soak instead (make soak): steady load on
// every front for DURATION, one fault of a random kind every minute, the
// processes' heap, goroutines, connections, file descriptors and log lines
// and Postgres's WAL and table sizes sampled throughout, a report every
// minute and a Markdown report at the end; it fails on a leak, a log storm
// or any event lost or doubled (see soak.go).
//
//	go run ./harness/chaos     # the full run: 100,000 Kafka + 100,000 NATS events, two-hop pipelines
//	make chaos-short           # the shorter run CI does
//	make chaos-failover        # the failovers, at the size CI runs
//	make soak                  # an hour of steady load and a fault a minute (SOAK_DURATION=10m)
//
// Services come from the environment or .services.env (make services-up):
// JUSTONCE_TEST_POSTGRES_URL, JUSTONCE_TEST_KAFKA_BROKERS. Postgres and
// Kafka crashes need the services started by scripts/services.sh: the
// harness reads their pid files under JUSTONCE_SERVICES_DIR (default
// /tmp/justonce-services) and restarts them with the script, which reads
// the same JUSTONCE_* variables; they are running and healthy at the end.
// Redis is a private redis-server it starts and stops; NATS is a real
// nats-server embedded in this process. The run is split in stages:
// setup (setup.go), the fronts and their producers (fronts.go, grpc.go,
// hop.go), the fault schedule and one type per fault kind (fault.go,
// schedule.go), and the verdict (verdict.go); the workers are worker.go.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"
)

type options struct {
	events          int           // unique events per transport
	dupPct          int           // duplicates, percent of all events produced
	workers         int           // consumer processes per transport
	kills           int           // SIGKILLs at least, over both transports
	httpKeys        int           // distinct HTTP keys
	httpClients     int           // concurrent clients per HTTP key
	grpcKeys        int           // distinct gRPC keys
	redisOutages    int           // Redis stop/start cycles
	pgTerminates    int           // pg_terminate_backend rounds
	pgCrashes       int           // Postgres SIGKILL + restart
	kafkaCrashes    int           // Kafka SIGKILL + restart
	natsRestarts    int           // NATS server restarts
	natsSyncAlways  bool          // JetStream sync_always
	netFaults       int           // network fault episodes
	hostileEvery    int           // every n-th event is hostile
	releases        int           // operator release rounds
	janitor         bool          // run the janitor
	timeout         time.Duration // give up after
	transports      string        // kafka,nats,http (and franz, grpc)
	batch           int           // consumer batch size (0: per event)
	killEvery       time.Duration
	layout          string        // ledger layout: plain or buckets
	bucketWidth     time.Duration // time buckets: how often each shard moves to a new bucket
	twoHop          int           // unique source events of the kafka>nats pipeline (0: off)
	twoHopHTTPKeys  int           // Idempotency-Keys of the http>kafka pipeline (0: off)
	hopWorkers      int           // processes per pipeline role (A and B of each pipeline)
	relays          int           // outbox relay processes
	relayKills      int           // SIGKILLs of relay processes at least
	kafkaPub        string        // the relays' Kafka publisher: kafka-go or franz-go
	pgFailovers     int           // Postgres primary SIGKILLed, synchronous standby promoted (0: a single Postgres)
	redisFailovers  int           // Redis master SIGKILLed, Sentinel promotes the replica (0: a single Redis)
	natsLeaderKills int           // the JetStream stream leader's node killed (0: a single NATS server)
	overloads       int           // every handler stalled on the effects table for overloadFor (0: none)
	overloadFor     time.Duration // how long an overload holds the handlers
	stepsKills      int           // SIGKILLs of the payment service in steps (0: off)
	stepsPayments   int           // payments a front of the steps fault
	soak            soakOptions   // -soak: a soak run instead (soak.go)
}

// ha reports whether the run uses a service with a standby for name:
// postgres, redis or nats.
func (o *options) ha(name string) bool {
	switch name {
	case "postgres":
		return o.pgFailovers > 0
	case "redis":
		return o.redisFailovers > 0
	case "nats":
		return o.natsLeaderKills > 0
	}
	return false
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "worker" {
		os.Exit(worker(os.Args[2:]))
	}
	if len(os.Args) > 1 && os.Args[1] == "steps-worker" {
		os.Exit(stepsWorker())
	}
	o := parseFlags()
	if err := o.check(); err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(2)
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	if o.soak.duration > 0 {
		os.Exit(soak(ctx, o))
	}
	ctx, cancelT := context.WithTimeout(ctx, o.timeout)
	defer cancelT()
	sum, err := run(ctx, o, nil)
	sum.print(os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
	if sum.violations() > 0 {
		os.Exit(1)
	}
}

func parseFlags() options {
	var o options
	flag.IntVar(&o.events, "events", 100_000, "unique events per transport")
	flag.IntVar(&o.dupPct, "dup-pct", 20, "duplicates as a percentage of all events produced")
	flag.IntVar(&o.workers, "workers", 3, "consumer processes per transport")
	flag.IntVar(&o.kills, "kills", 20, "SIGKILL at least this many consumer processes")
	flag.IntVar(&o.httpKeys, "http-keys", 2000, "distinct Idempotency-Keys")
	flag.IntVar(&o.httpClients, "http-clients", 3, "concurrent clients per key (HTTP and gRPC)")
	flag.IntVar(&o.grpcKeys, "grpc-keys", 2000, "distinct gRPC idempotency keys (with grpc in -transports)")
	flag.IntVar(&o.redisOutages, "redis-outages", 3, "stop and start Redis this many times")
	flag.IntVar(&o.pgTerminates, "pg-terminates", 5, "terminate the workers' Postgres connections this many times")
	flag.IntVar(&o.pgCrashes, "pg-crashes", 3, "SIGKILL the Postgres postmaster and restart it this many times")
	flag.IntVar(&o.kafkaCrashes, "kafka-crashes", 3, "SIGKILL the Kafka broker and restart it this many times")
	flag.IntVar(&o.natsRestarts, "nats-restarts", 3, "restart the NATS server (file store) this many times")
	flag.BoolVar(&o.natsSyncAlways, "nats-sync-always", false, "run JetStream with sync_always")
	flag.IntVar(&o.netFaults, "net-faults", 9, "network fault episodes (reset-peer, latency, timeout in turn)")
	flag.IntVar(&o.hostileEvery, "hostile-every", 200, "every n-th event's handler is hostile (0: none)")
	flag.IntVar(&o.releases, "releases", 4, "operator rounds releasing and resending failed keys")
	flag.BoolVar(&o.janitor, "janitor", true, "run the janitor on short-lived rows during the run")
	flag.DurationVar(&o.timeout, "timeout", 40*time.Minute, "give up after this long")
	flag.StringVar(&o.transports, "transports", "kafka,nats,http", "what to run: kafka, nats, http, and also franz (a franzinbox consumer group) and grpc (the gRPC bridge)")
	flag.IntVar(&o.batch, "batch", 0, "consumer batch size (0: one transaction per event)")
	flag.DurationVar(&o.killEvery, "kill-every", 700*time.Millisecond, "pause between faults")
	flag.StringVar(&o.layout, "layout", "plain", "ledger layout: plain or buckets (migrations.LayoutTimeBuckets)")
	flag.DurationVar(&o.bucketWidth, "bucket-width", 20*time.Second, "with -layout buckets: how often each shard moves to a new bucket (the janitor opens them), so that buckets turn over and the workers' views of them go stale during the run")
	flag.IntVar(&o.twoHop, "two-hop", 20_000, "unique source events of the two-hop Kafka → A (inbox + outbox) → NATS → B pipeline (0: off)")
	flag.IntVar(&o.twoHopHTTPKeys, "two-hop-http-keys", 1000, "Idempotency-Keys of the two-hop HTTP → A (bridge + outbox) → Kafka → B pipeline (0: off)")
	flag.IntVar(&o.hopWorkers, "hop-workers", 2, "processes per two-hop role (A and B of each pipeline)")
	flag.IntVar(&o.relays, "relays", 2, "outbox relay processes (the HTTP pipeline's A processes run one each too)")
	flag.IntVar(&o.relayKills, "relay-kills", 6, "SIGKILL outbox relay processes at least this many times (on top of -kills)")
	flag.StringVar(&o.kafkaPub, "kafka-publisher", pubKafkaGo, "the outbox relays' Kafka client: "+pubKafkaGo+" (kafkainbox.NewOutboxPublisher) or "+pubFranzGo+" (franzinbox.NewOutboxPublisher)")
	flag.IntVar(&o.pgFailovers, "pg-failovers", 0, "run on a Postgres primary with a synchronous streaming standby (started by the run) and fail over this many times: SIGKILL the primary, promote the standby, rebuild the dead node as its standby (0: the single Postgres of services.sh)")
	flag.IntVar(&o.redisFailovers, "redis-failovers", 0, "run the ledgers' Redis behind Sentinel (a master, a replica, three sentinels, started by the run) and fail over this many times: SIGKILL the master, wait for the sentinels to promote the replica (0: a single Redis)")
	flag.IntVar(&o.overloads, "overloads", 0, "overload the ledger's Postgres this many times: a SHARE lock on the effects table holds every handler's INSERT, with its connection, for -overload-for, so that the workers' pools fill, the HTTP and gRPC bridges shed (503 overloaded, Unavailable OVERLOADED) and the clients retry, and the consumers stall with their fetches paused (0: none)")
	flag.DurationVar(&o.overloadFor, "overload-for", 3*time.Second, "how long each -overloads episode holds the handlers (over the bridges' AcquireWait, 1 s, for them to shed)")
	flag.IntVar(&o.natsLeaderKills, "nats-leader-kills", 0, "run NATS as a three-node JetStream cluster (streams with Replicas 3) and kill the node leading the stream this many times (0: a single NATS server)")
	flag.IntVar(&o.stepsKills, "steps-kills", 0, "after the run, SIGKILL the payment service in steps (examples/payments/stepspay, on every front) this many times, between and inside its steps, and check each payment was charged once (0: off)")
	flag.IntVar(&o.stepsPayments, "steps-payments", 200, "payments a front with -steps-kills")
	o.soak.flags(flag.CommandLine)
	flag.Parse()
	return o
}

// check refuses options that cannot run together.
func (o *options) check() error {
	if o.kafkaPub != pubKafkaGo && o.kafkaPub != pubFranzGo {
		return fmt.Errorf("-kafka-publisher %q: want %s or %s", o.kafkaPub, pubKafkaGo, pubFranzGo)
	}
	for _, n := range []int{o.pgFailovers, o.redisFailovers, o.natsLeaderKills} {
		if n < 0 {
			return fmt.Errorf("a failover count is negative")
		}
	}
	if o.overloads < 0 || o.overloadFor <= 0 {
		return fmt.Errorf("-overloads is negative or -overload-for not positive")
	}
	if o.stepsKills < 0 || (o.stepsKills > 0 && o.stepsPayments < 1) {
		return fmt.Errorf("-steps-kills is negative, or -steps-payments under 1")
	}
	return nil
}

// self returns a command running this binary in worker mode.
func self(args ...string) (*exec.Cmd, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, append([]string{"worker"}, args...)...)
	cmd.Stdout = os.Stderr
	cmd.Stderr = os.Stderr
	return cmd, nil
}

// errOut is where the parent's own log lines go: stderr, or a counting
// writer in a soak run (log lines per minute are a measure).
var errOut io.Writer = os.Stderr
