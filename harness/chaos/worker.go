package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

const scope = "chaos"

// redisLockTTL is the workers' Redis lock lifetime; slow hostile handlers
// run longer than it.
const redisLockTTL = 600 * time.Millisecond

// newLedger opens a pool and a ledger, Redis in front.
func newLedger(ctx context.Context, pgURL, redisAddr, name string) (*inbox.Ledger, func(), error) {
	l, _, closeAll, err := newLedgerPool(ctx, pgURL, redisAddr, name)
	return l, closeAll, err
}

// newLedgerPool is newLedger, and returns the pool too.
func newLedgerPool(ctx context.Context, pgURL, redisAddr, name string) (*inbox.Ledger, *pgxpool.Pool, func(), error) {
	cfg, err := pgxpool.ParseConfig(pgURL)
	if err != nil {
		return nil, nil, nil, err
	}
	cfg.MaxConns = 6
	cfg.ConnConfig.ConnectTimeout = 3 * time.Second
	// The chaos parent terminates connections by this name.
	cfg.ConnConfig.RuntimeParams["application_name"] = "chaos-" + name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, nil, err
	}
	rc := redis.NewClient(&redis.Options{Addr: redisAddr, ContextTimeoutEnabled: true, MaxRetries: 1,
		DialTimeout: 100 * time.Millisecond, ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond})
	l, err := inbox.New(pool, inbox.Config{
		Redis:  &inbox.RedisConfig{Client: rc, Timeout: 100 * time.Millisecond, LockTTL: redisLockTTL},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))})
	if err != nil {
		pool.Close()
		return nil, nil, nil, err
	}
	return l, pool, func() { _ = rc.Close(); pool.Close() }, nil
}

// reporter writes one line per observation to stdout, which the parent
// reads: "@ev <name>".
type reporter struct {
	mu    sync.Mutex
	first sync.Once
}

func (r *reporter) report(ev string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fmt.Fprintln(os.Stdout, "@ev", ev)
}

// classify names the error of a failed attempt for the parent's counts.
func classify(err error) string {
	var pgErr *pgconn.PgError
	var panicErr *consumer.PanicError
	switch {
	case strings.HasPrefix(err.Error(), "dead letter:"):
		// consumer's deadLetter: the dead-letter publish failed; the
		// message is retried (and its handler runs again).
		return "dead-letter-publish"
	case errors.Is(err, inbox.ErrCommitUnknown):
		return "commit-unknown"
	case errors.Is(err, inbox.ErrRolledBack):
		return "rolled-back"
	case errors.As(err, &panicErr):
		return "panic-error"
	case errors.As(err, &pgErr) && pgErr.Code == "23503":
		return "deferred-fk-error"
	case inbox.IsTransient(err):
		return "transient"
	}
	return "other"
}

func processorConfig(l *inbox.Ledger, r *reporter) consumer.Config {
	return consumer.Config{
		Ledger: l, Scope: scope, MaxAttempts: maxAttempts,
		Backoff:      backoff.Backoff{Initial: 20 * time.Millisecond, Max: 300 * time.Millisecond},
		StoreBackoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond},
		Hooks: consumer.Hooks{
			OnOutcome: func(_ *consumer.Message, out inbox.Outcome, _ time.Duration) {
				if out.Disposition == inbox.Executed {
					r.first.Do(func() { r.report("first-effect") })
				}
			},
			OnRetry: func(m *consumer.Message, err error) {
				if err != nil {
					c := classify(err)
					r.report("retry:" + c)
					if c == "other" {
						fmt.Fprintf(os.Stderr, "chaos worker: %s attempt %d (uncounted %d): %v\n", m.ID, m.Attempt, m.Uncounted, err)
					}
				}
			},
			OnDeadLetter: func(_ *consumer.Message, cause error) {
				r.report("dead-letter:" + classify(cause))
			},
		},
	}
}

// worker runs one consumer process until SIGTERM (or SIGKILL).
func worker(args []string) int {
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	transport := fs.String("transport", "", "kafka or nats")
	name := fs.String("name", "w", "worker name")
	pgURL := fs.String("pg", "", "Postgres URL (search_path set)")
	redisAddr := fs.String("redis", "", "Redis address")
	brokers := fs.String("brokers", "", "Kafka brokers")
	topic := fs.String("topic", "", "Kafka topic")
	natsURL := fs.String("nats", "", "NATS URL")
	stream := fs.String("stream", "", "JetStream stream")
	batch := fs.Int("batch", 0, "batch size")
	every := fs.Int("hostile-every", 0, "every n-th event is hostile (0: none)")
	slowFor := fs.Duration("slow", 2*redisLockTTL, "how long slow handlers take")
	listen := fs.String("listen", "", "HTTP listen address (hop-hk-a)")
	relay := fs.Bool("relay", false, "run an outbox relay in this process too")
	relayBatch := fs.Int("relay-batch", 100, "relay batch size")
	relayPoll := fs.Duration("relay-poll", 200*time.Millisecond, "relay poll interval")
	kafkaPub := fs.String("kafka-publisher", pubKafkaGo, "the relay's Kafka client: "+pubKafkaGo+" or "+pubFranzGo)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	l, pool, closeAll, err := newLedgerPool(ctx, *pgURL, *redisAddr, *name)
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	defer closeAll()
	r := &reporter{}
	pc := processorConfig(l, r)
	if strings.HasPrefix(*transport, "hop-") || *transport == roleRelay {
		a := &hopArgs{role: *transport, name: *name, brokers: *brokers, topic: *topic, natsURL: *natsURL,
			listen: *listen, relay: *relay, batch: *batch, every: *every, slowFor: *slowFor,
			relayBatch: *relayBatch, relayPoll: *relayPoll, kafkaPub: *kafkaPub, hostileInA: *every > 0,
			ledger: l, pool: pool, report: r.report, pc: pc,
			errLog: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))}
		code := hopWorker(ctx, a)
		if a.natsConn != nil {
			a.natsConn.Close()
		}
		return code
	}
	h := hostileHandler(*transport, *every, *slowFor, func(s string) { r.report("hostile:" + s) })
	// Both fronts have the same shape: New(cfg, h), then Run, which
	// returns nil after a clean stop.
	var c interface{ Run(context.Context) error }
	switch *transport {
	case "kafka":
		c, err = kafkainbox.New(kafkainbox.Config{
			Brokers: strings.Split(*brokers, ","), Topic: *topic, GroupID: "chaos-" + *topic,
			Processor: pc, Scheduling: consumer.Scheduling{BatchSize: *batch}, CommitInterval: 200 * time.Millisecond,
		}, h)
	case "nats":
		nc, cerr := nats.Connect(*natsURL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond),
			nats.RetryOnFailedConnect(true))
		if cerr != nil {
			fmt.Fprintln(os.Stderr, "worker:", cerr)
			return 1
		}
		defer nc.Close()
		c, err = natsinbox.New(natsinbox.Config{Conn: nc, Stream: *stream, Durable: "chaos",
			Processor: pc, AckWait: 5 * time.Second, Scheduling: consumer.Scheduling{BatchSize: *batch}}, h)
	default:
		fmt.Fprintln(os.Stderr, "worker: -transport kafka|nats")
		return 2
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	if err := c.Run(ctx); err != nil {
		fmt.Fprintf(os.Stderr, "worker %s: %v\n", *transport, err)
		return 1
	}
	return 0
}
