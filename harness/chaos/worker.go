package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"sort"
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
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
	"github.com/justonce/justonce/transports/kafkainbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

const scope = "chaos"

// redisLockTTL is the workers' Redis lock lifetime; slow hostile handlers
// run longer than it.
const redisLockTTL = 600 * time.Millisecond

// redisConf is how a worker reaches the ledgers' Redis: one address, or
// sentinels (the failover client), each data node's address mapped to
// the fault proxy's in front of it.
type redisConf struct {
	addr      string
	sentinels []string
	via       map[string]string
}

// args gives c as a worker's flags.
func (c redisConf) args() []string {
	if len(c.sentinels) == 0 {
		return []string{"-redis", c.addr}
	}
	var via []string
	for k, v := range c.via {
		via = append(via, k+"="+v)
	}
	sort.Strings(via)
	return []string{"-redis-sentinels", strings.Join(c.sentinels, ","), "-redis-via", strings.Join(via, ",")}
}

// parseVia reads "addr=proxy,addr=proxy".
func parseVia(s string) map[string]string {
	m := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			m[k] = v
		}
	}
	return m
}

// client returns the worker's Redis client, with short timeouts.
func (c redisConf) client() redis.UniversalClient {
	if len(c.sentinels) == 0 {
		return redis.NewClient(&redis.Options{Addr: c.addr, ContextTimeoutEnabled: true, MaxRetries: 1,
			DialTimeout: 100 * time.Millisecond, ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond})
	}
	var d net.Dialer
	return redis.NewFailoverClient(&redis.FailoverOptions{MasterName: testsvc.SentinelMasterName, SentinelAddrs: c.sentinels,
		ContextTimeoutEnabled: true, MaxRetries: 1,
		DialTimeout: 100 * time.Millisecond, ReadTimeout: 200 * time.Millisecond, WriteTimeout: 200 * time.Millisecond,
		// The sentinels name the master by its own address: reach it
		// through the fault proxy in front of it.
		Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
			if p, ok := c.via[addr]; ok {
				addr = p
			}
			return d.DialContext(ctx, network, addr)
		}})
}

// newLedger opens a pool and a ledger, Redis in front.
func newLedger(ctx context.Context, pgURL string, rc redisConf, name string) (*inbox.Ledger, func(), error) {
	l, _, closeAll, err := newLedgerPool(ctx, pgURL, rc, name)
	return l, closeAll, err
}

// newLedgerPool is newLedger, and returns the pool too.
func newLedgerPool(ctx context.Context, pgURL string, redisC redisConf, name string) (*inbox.Ledger, *pgxpool.Pool, func(), error) {
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
	rc := redisC.client()
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
	r.raw("@ev " + ev)
}

// raw writes one line to stdout.
func (r *reporter) raw(line string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	fmt.Fprintln(os.Stdout, line)
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

// workerFlags are a worker process's flags.
type workerFlags struct {
	transport, name, pgURL, brokers, topic, natsURL, stream, listen, kafkaPub string
	redis                                                                     redisConf
	batch, every, relayBatch                                                  int
	slowFor, relayPoll, statsEvery                                            time.Duration
	relay                                                                     bool
}

func parseWorkerFlags(args []string) (*workerFlags, error) {
	var f workerFlags
	var sentinels, via string
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	fs.StringVar(&f.transport, "transport", "", "kafka, franz, nats, http, grpc, or a pipeline role")
	fs.StringVar(&f.name, "name", "w", "worker name")
	fs.StringVar(&f.pgURL, "pg", "", "Postgres connection string (search_path set)")
	fs.StringVar(&f.redis.addr, "redis", "", "Redis address")
	fs.StringVar(&sentinels, "redis-sentinels", "", "Redis sentinels' addresses (instead of -redis): the Sentinel failover client")
	fs.StringVar(&via, "redis-via", "", "with -redis-sentinels: addr=proxy,... the fault proxy in front of each data node")
	fs.StringVar(&f.brokers, "brokers", "", "Kafka brokers")
	fs.StringVar(&f.topic, "topic", "", "Kafka topic")
	fs.StringVar(&f.natsURL, "nats", "", "NATS URL(s), comma-separated")
	fs.StringVar(&f.stream, "stream", "", "JetStream stream")
	fs.IntVar(&f.batch, "batch", 0, "batch size")
	fs.IntVar(&f.every, "hostile-every", 0, "every n-th event is hostile (0: none)")
	fs.DurationVar(&f.slowFor, "slow", 2*redisLockTTL, "how long slow handlers take")
	fs.StringVar(&f.listen, "listen", "", "listen address (http, grpc, hop-hk-a)")
	fs.BoolVar(&f.relay, "relay", false, "run an outbox relay in this process too")
	fs.IntVar(&f.relayBatch, "relay-batch", 100, "relay batch size")
	fs.DurationVar(&f.relayPoll, "relay-poll", 200*time.Millisecond, "relay poll interval")
	fs.StringVar(&f.kafkaPub, "kafka-publisher", pubKafkaGo, "the relay's Kafka client: "+pubKafkaGo+" or "+pubFranzGo)
	fs.DurationVar(&f.statsEvery, "stats-every", 0, "report runtime stats and latencies this often (0: off)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if sentinels != "" {
		f.redis.sentinels = strings.Split(sentinels, ",")
		f.redis.via = parseVia(via)
	}
	return &f, nil
}

// worker runs one consumer process until SIGTERM (or SIGKILL).
func worker(args []string) int {
	f, err := parseWorkerFlags(args)
	if err != nil {
		return 2
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer cancel()
	l, pool, closeAll, err := newLedgerPool(ctx, f.pgURL, f.redis, f.name)
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 1
	}
	defer closeAll()
	r := &reporter{}
	var stats *workerStats
	if f.statsEvery > 0 {
		stats = newWorkerStats(r, pool)
		go stats.run(ctx, f.statsEvery)
	}
	pc := processorConfig(l, r)
	if strings.HasPrefix(f.transport, "hop-") || f.transport == roleRelay {
		a := &hopArgs{role: f.transport, name: f.name, brokers: f.brokers, topic: f.topic, natsURL: f.natsURL,
			listen: f.listen, relay: f.relay, batch: f.batch, every: f.every, slowFor: f.slowFor,
			relayBatch: f.relayBatch, relayPoll: f.relayPoll, kafkaPub: f.kafkaPub, hostileInA: f.every > 0,
			ledger: l, pool: pool, report: r.report, pc: pc, stats: stats,
			errLog: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))}
		code := hopWorker(ctx, a)
		if a.natsConn != nil {
			a.natsConn.Close()
		}
		return code
	}
	if err := f.serve(ctx, l, pc, r, stats); errors.Is(err, errUnknownTransport) {
		fmt.Fprintln(os.Stderr, "worker: -transport kafka|franz|nats|http|grpc")
		return 2
	} else if err != nil {
		fmt.Fprintf(os.Stderr, "worker %s: %v\n", f.transport, err)
		return 1
	}
	return 0
}

var errUnknownTransport = errors.New("unknown transport")

// serve runs the worker's front until ctx ends: a consumer (kafka, franz,
// nats), or a server (http, grpc).
func (f *workerFlags) serve(ctx context.Context, l *inbox.Ledger, pc consumer.Config, r *reporter, stats *workerStats) error {
	if stats != nil {
		outcome := pc.Hooks.OnOutcome
		pc.Hooks.OnOutcome = func(m *consumer.Message, out inbox.Outcome, d time.Duration) {
			outcome(m, out, d)
			if out.Disposition == inbox.Executed && !m.Time.IsZero() {
				stats.observe(f.transport, time.Since(m.Time))
			}
		}
	}
	h := hostileHandler(f.transport, f.every, f.slowFor, func(s string) { r.report("hostile:" + s) })
	// The consumer fronts have the same shape: New(cfg, h), then Run,
	// which returns nil after a clean stop.
	var c interface{ Run(context.Context) error }
	var err error
	switch f.transport {
	case "kafka":
		c, err = kafkainbox.New(kafkainbox.Config{
			Brokers: strings.Split(f.brokers, ","), Topic: f.topic, GroupID: "chaos-" + f.topic,
			Processor: pc, Scheduling: consumer.Scheduling{BatchSize: f.batch}, CommitInterval: 200 * time.Millisecond,
		}, h)
	case "franz":
		c, err = franzinbox.New(franzinbox.Config{
			Brokers: strings.Split(f.brokers, ","), Topics: []string{f.topic}, GroupID: "chaos-" + f.topic,
			Processor: pc, Scheduling: consumer.Scheduling{BatchSize: f.batch}, CommitInterval: 200 * time.Millisecond,
		}, h)
	case "nats":
		nc, cerr := nats.Connect(f.natsURL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond),
			nats.RetryOnFailedConnect(true))
		if cerr != nil {
			return cerr
		}
		defer nc.Close()
		c, err = natsinbox.New(natsinbox.Config{Conn: nc, Stream: f.stream, Durable: "chaos",
			Processor: pc, AckWait: 5 * time.Second, Scheduling: consumer.Scheduling{BatchSize: f.batch}}, h)
	case "http":
		srv, err := httpServer(ctx, f.pgURL, f.redis, f.name, f.listen)
		if err != nil {
			return err
		}
		<-ctx.Done()
		srv.Close()
		return nil
	case "grpc":
		return grpcWorker(ctx, l, f.listen)
	default:
		return errUnknownTransport
	}
	if err != nil {
		return err
	}
	return c.Run(ctx)
}
