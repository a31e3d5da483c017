package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/redis/go-redis/v9"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	kafkainbox "github.com/justonce/justonce/transports/kafka"
	natsinbox "github.com/justonce/justonce/transports/nats"
)

const scope = "chaos"

// effect is the business handler: one row per run, no unique constraint,
// so a doubled effect shows.
func effect(transport string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, transport) VALUES ($1, $2)`, m.ID, transport)
		return err
	}
}

// newLedger opens the worker's pool and ledger, Redis in front.
func newLedger(ctx context.Context, pgURL, redisAddr, name string) (*inbox.Ledger, func(), error) {
	cfg, err := pgxpool.ParseConfig(pgURL)
	if err != nil {
		return nil, nil, err
	}
	cfg.MaxConns = 6
	// The chaos parent terminates connections by this name.
	cfg.ConnConfig.RuntimeParams["application_name"] = "chaos-" + name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	rc := redis.NewClient(&redis.Options{Addr: redisAddr, ContextTimeoutEnabled: true, MaxRetries: 1,
		DialTimeout: 100 * time.Millisecond, ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond})
	l, err := inbox.New(pool, inbox.Config{Redis: &inbox.RedisConfig{Client: rc, Timeout: 100 * time.Millisecond},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		return nil, nil, err
	}
	return l, func() { _ = rc.Close(); pool.Close() }, nil
}

func processorConfig(l *inbox.Ledger) consumer.Config {
	return consumer.Config{
		Ledger: l, Scope: scope, MaxAttempts: 1000, // nothing here is poison: never dead-letter a fault
		Backoff:      consumer.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond},
		StoreBackoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond},
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
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	l, closeAll, err := newLedger(ctx, *pgURL, *redisAddr, *name)
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	defer closeAll()
	pc := processorConfig(l)
	switch *transport {
	case "kafka":
		c, err := kafkainbox.New(kafkainbox.Config{
			Brokers: strings.Split(*brokers, ","), Topic: *topic, GroupID: "chaos-" + *topic,
			Processor: pc, BatchSize: *batch, CommitInterval: 200 * time.Millisecond,
		}, effect("kafka"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "worker:", err)
			return 1
		}
		err = c.Run(ctx)
		if err != nil && ctx.Err() == nil {
			fmt.Fprintln(os.Stderr, "worker kafka:", err)
			return 1
		}
	case "nats":
		nc, err := nats.Connect(*natsURL, nats.MaxReconnects(-1))
		if err != nil {
			fmt.Fprintln(os.Stderr, "worker:", err)
			return 1
		}
		defer nc.Close()
		c, err := natsinbox.New(natsinbox.Config{Conn: nc, Stream: *stream, Durable: "chaos", Handler: effect("nats"),
			Processor: pc, AckWait: 5 * time.Second, Batch: *batch})
		if err != nil {
			fmt.Fprintln(os.Stderr, "worker:", err)
			return 1
		}
		err = c.Run(ctx)
		if err != nil && ctx.Err() == nil {
			fmt.Fprintln(os.Stderr, "worker nats:", err)
			return 1
		}
	default:
		fmt.Fprintln(os.Stderr, "worker: -transport kafka|nats")
		return 2
	}
	return 0
}
