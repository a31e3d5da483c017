// Command chaos tries hard to break justonce's exactly-once claim and
// checks, from the business table and the ledger, that it held.
//
// It produces events with duplicates to a real Kafka topic (duplicates at
// later offsets) and a JetStream stream (duplicates republished after the
// stream's duplicate window), runs several consumer processes per transport
// (this same binary, in worker mode), and during the run SIGKILLs workers at
// random and restarts them, stops and restarts Redis, and terminates the
// workers' Postgres connections (pg_terminate_backend). In parallel, HTTP
// clients send requests with Idempotency-Keys, several clients per key,
// retrying through a real server. At the end every event and request must
// have exactly one effect. It prints a summary and exits 1 on any violation.
//
//	go run ./internal/chaos                    # the full run: 100,000 Kafka + 100,000 NATS events
//	go run ./internal/chaos -events 10000 -kills 8   # the shorter run CI does
//
// Services come from the environment or .services.env (make services-up):
// JUSTONCE_TEST_POSTGRES_URL, JUSTONCE_TEST_KAFKA_BROKERS; Redis is a
// private redis-server it starts (and stops); NATS is a real nats-server
// embedded in this process.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"
)

type options struct {
	events       int           // unique events per transport
	dupPct       int           // duplicates, percent of all events produced
	workers      int           // consumer processes per transport
	kills        int           // SIGKILLs at least, over both transports
	httpKeys     int           // distinct HTTP keys
	httpClients  int           // concurrent clients per HTTP key
	redisOutages int           // Redis stop/start cycles at least
	pgTerminates int           // pg_terminate_backend rounds at least
	timeout      time.Duration // give up after
	transports   string        // kafka,nats,http
	batch        int           // consumer batch size (0: per event)
	killEvery    time.Duration
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "worker" {
		os.Exit(worker(os.Args[2:]))
	}
	var o options
	flag.IntVar(&o.events, "events", 100_000, "unique events per transport")
	flag.IntVar(&o.dupPct, "dup-pct", 20, "duplicates as a percentage of all events produced")
	flag.IntVar(&o.workers, "workers", 3, "consumer processes per transport")
	flag.IntVar(&o.kills, "kills", 20, "SIGKILL at least this many consumer processes")
	flag.IntVar(&o.httpKeys, "http-keys", 2000, "distinct Idempotency-Keys")
	flag.IntVar(&o.httpClients, "http-clients", 3, "concurrent clients per key")
	flag.IntVar(&o.redisOutages, "redis-outages", 3, "stop and start Redis at least this many times")
	flag.IntVar(&o.pgTerminates, "pg-terminates", 5, "terminate the workers' Postgres connections at least this many times")
	flag.DurationVar(&o.timeout, "timeout", 20*time.Minute, "give up after this long")
	flag.StringVar(&o.transports, "transports", "kafka,nats,http", "what to run")
	flag.IntVar(&o.batch, "batch", 0, "consumer batch size (0: one transaction per event)")
	flag.DurationVar(&o.killEvery, "kill-every", 700*time.Millisecond, "pause between faults")
	flag.Parse()

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	ctx, cancelT := context.WithTimeout(ctx, o.timeout)
	defer cancelT()
	sum, err := run(ctx, o)
	sum.print(os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
	if sum.violations() > 0 {
		os.Exit(1)
	}
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
