package kafkainbox_test

import (
	"context"
	"encoding/binary"
	"os"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// benchEvents is how many events each variant consumes per round of
// BenchmarkConsumer; benchPaced how many one-at-a-time events each
// variant answers per round of the latency measurement.
const (
	benchEvents = 5000
	benchPaced  = 200
)

// BenchmarkConsumer sizes its own work: each iteration (round) consumes
// the same benchEvents events (4 partitions, 64-byte payloads), from a
// fresh group and empty tables, with:
//   - bare: a plain kafka-go group reader, one message at a time, the
//     business INSERT in its own transaction (BEGIN; INSERT; COMMIT),
//     offsets committed every second, as the Consumer does;
//   - wrapped: a Consumer with the defaults (adaptive batching: the
//     messages already waiting run in one transaction, each as if in a
//     savepoint of its own), the same INSERT in the ledger's transaction;
//   - per_event: a Consumer with BatchSize 1 (one message, one
//     transaction);
//
// each timed from its first message to its last. The order of the three
// alternates between rounds, against drift in the machine's load.
//
// Metrics: events/s of each, wrapped/bare and per_event/bare (target
// ≥ 1.0 for the default). -benchtime=Nx runs N rounds (1x is enough to
// read the ratios; more average the noise).
func BenchmarkConsumer(b *testing.B) {
	brokers := testsvc.KafkaBrokers(b)
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, `CREATE TABLE effects (event_id text NOT NULL, value bytea)`)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	const n = benchEvents
	topic := newTopic(b, brokers, 4)
	publish(b, brokers, topic, events("bench", 0, n, 64)...)

	insert := func(ctx context.Context, tx pgx.Tx, id string, v []byte) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, id, v)
		return err
	}
	reset := func() { pg.Exec(b, `TRUNCATE effects, processed_events`) }

	bare := func() time.Duration {
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: brokers, Topic: topic, GroupID: testsvc.Unique("bare"),
			CommitInterval: time.Second, MaxWait: time.Second, HeartbeatInterval: time.Second,
		})
		defer r.Close()
		ctx := context.Background()
		var first time.Time
		for i := 0; i < n; i++ {
			m, err := r.FetchMessage(ctx)
			require.NoError(b, err)
			if i == 0 {
				first = time.Now()
			}
			id := string(m.Headers[0].Value)
			require.NoError(b, pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error { return insert(ctx, tx, id, m.Value) }))
			require.NoError(b, r.CommitMessages(ctx, m))
		}
		return time.Since(first)
	}

	wrapped := func(batch int) time.Duration {
		var first atomic.Pointer[time.Time]
		var done atomic.Int64
		finished := make(chan time.Time, 1)
		c, err := kafkainbox.New(kafkainbox.Config{
			Brokers: brokers, Topic: topic, GroupID: testsvc.Unique("wrapped"), Scheduling: consumer.Scheduling{BatchSize: batch},
			Processor: consumer.Config{Ledger: ledger, Hooks: consumer.Hooks{
				OnOutcome: func(*consumer.Message, inbox.Outcome, time.Duration) {
					if done.Add(1) == n {
						finished <- time.Now()
					}
				},
			}},
		}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if first.Load() == nil {
				now := time.Now()
				first.CompareAndSwap(nil, &now)
			}
			return insert(ctx, tx, m.ID, m.Value)
		})
		require.NoError(b, err)
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		go func() { ran <- c.Run(ctx) }()
		end := <-finished
		cancel()
		require.NoError(b, <-ran)
		return end.Sub(*first.Load())
	}

	var tBare, tWrapped, tPerEvent time.Duration
	for i := 0; i < b.N; i++ {
		runs := []func(){
			func() { tBare += bare() },
			func() {
				tWrapped += wrapped(0)
				require.Equal(b, n, pg.Count(b, `SELECT count(*) FROM effects`))
			},
			func() { tPerEvent += wrapped(1) },
		}
		for j := range runs {
			if i%2 == 1 {
				j = len(runs) - 1 - j
			}
			reset()
			runs[j]()
		}
	}
	rate := func(d time.Duration) float64 { return float64(n*b.N) / d.Seconds() }
	b.ReportMetric(float64(tWrapped.Nanoseconds())/float64(n*b.N), "ns/op") // per wrapped event
	b.ReportMetric(rate(tBare), "bare_ev/s")
	b.ReportMetric(rate(tWrapped), "wrapped_ev/s")
	b.ReportMetric(rate(tPerEvent), "per_event_ev/s")
	b.ReportMetric(rate(tWrapped)/rate(tBare), "wrapped/bare")
	b.ReportMetric(rate(tPerEvent)/rate(tBare), "per_event/bare")
}

// BenchmarkLatencyLowLoad sizes its own work: each iteration is a round in
// which benchPaced events are produced to a fresh one-partition topic one
// at a time, each after the previous one was handled, for the bare loop
// of BenchmarkConsumer and for a Consumer with the defaults, in
// alternating order; the latency from before the produce call to the
// handler's commit is measured. It reports p50 and p99 of each and the
// p99 ratio (target ≤ 1.2: batching adds no latency when nothing else is
// waiting).
func BenchmarkLatencyLowLoad(b *testing.B) {
	brokers := testsvc.KafkaBrokers(b)
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, `CREATE TABLE effects (event_id text NOT NULL, value bytea)`)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	insert := func(ctx context.Context, tx pgx.Tx, id string, v []byte) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, id, v)
		return err
	}
	var latBare, latWrapped []time.Duration
	for i := 0; i < b.N*latencyRounds(); i++ {
		if i%2 == 0 {
			latBare = append(latBare, pacedLatency(b, brokers, pg, insert, false, ledger)...)
			latWrapped = append(latWrapped, pacedLatency(b, brokers, pg, insert, true, ledger)...)
		} else {
			latWrapped = append(latWrapped, pacedLatency(b, brokers, pg, insert, true, ledger)...)
			latBare = append(latBare, pacedLatency(b, brokers, pg, insert, false, ledger)...)
		}
	}
	pb, pw := quantile(latBare, 99), quantile(latWrapped, 99)
	b.ReportMetric(float64(quantile(latBare, 50).Microseconds())/1000, "p50_bare_ms")
	b.ReportMetric(float64(quantile(latWrapped, 50).Microseconds())/1000, "p50_wrapped_ms")
	b.ReportMetric(float64(pb.Microseconds())/1000, "p99_bare_ms")
	b.ReportMetric(float64(pw.Microseconds())/1000, "p99_wrapped_ms")
	b.ReportMetric(float64(pw)/float64(pb), "p99_wrapped/bare")
}

// quantile is the q-th percentile of ds.
func quantile(ds []time.Duration, q int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)*q-1)/100]
}

// pacedLatency produces benchPaced events to a fresh one-partition topic,
// one at a time, each after the previous one was handled, and returns the
// latency of each, from before the produce call to the handler's commit,
// for the bare loop or a default Consumer.
func pacedLatency(b *testing.B, brokers []string, pg *testsvc.PG, insert func(context.Context, pgx.Tx, string, []byte) error, useConsumer bool, ledger *inbox.Ledger) []time.Duration {
	topic := newTopic(b, brokers, 1)
	handled := make(chan time.Duration, 1)
	lat := func(v []byte) time.Duration {
		return time.Since(time.Unix(0, int64(binary.BigEndian.Uint64(v))))
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	if useConsumer {
		c, err := kafkainbox.New(kafkainbox.Config{
			Brokers: brokers, Topic: topic, GroupID: testsvc.Unique("lat-wrapped"),
			Processor: consumer.Config{Ledger: ledger, Hooks: consumer.Hooks{
				OnOutcome: func(m *consumer.Message, _ inbox.Outcome, _ time.Duration) { handled <- lat(m.Value) },
			}},
		}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return insert(ctx, tx, m.ID, m.Value)
		})
		require.NoError(b, err)
		go func() {
			defer close(stopped)
			_ = c.Run(ctx)
		}()
	} else {
		r := kafka.NewReader(kafka.ReaderConfig{
			Brokers: brokers, Topic: topic, GroupID: testsvc.Unique("lat-bare"),
			CommitInterval: time.Second, MaxWait: time.Second, HeartbeatInterval: time.Second,
		})
		go func() {
			defer close(stopped)
			defer r.Close()
			for {
				m, err := r.FetchMessage(ctx)
				if err != nil {
					return
				}
				id := string(m.Headers[0].Value)
				if err := pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error { return insert(ctx, tx, id, m.Value) }); err != nil {
					return
				}
				handled <- lat(m.Value)
				_ = r.CommitMessages(ctx, m)
			}
		}()
	}
	defer func() {
		cancel()
		<-stopped
	}()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, RequiredAcks: kafka.RequireOne,
		BatchSize: 1, BatchTimeout: time.Millisecond, Transport: tr}
	defer w.Close()
	out := make([]time.Duration, 0, benchPaced)
	for i := -1; i < benchPaced; i++ { // event -1 warms the group up, unmeasured
		v := make([]byte, 64)
		binary.BigEndian.PutUint64(v, uint64(time.Now().UnixNano()))
		m := kafkainbox.NewMessage(testsvc.Unique("lat"), nil, v)
		wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
		require.NoError(b, w.WriteMessages(wctx, m))
		wcancel()
		select {
		case d := <-handled:
			if i >= 0 {
				out = append(out, d)
			}
		case <-time.After(60 * time.Second):
			b.Fatal("a paced event was not handled within 60 s")
		}
	}
	return out
}

// latencyRounds is how many rounds the low-load latency benchmark runs per
// iteration, whatever -benchtime says: a p99 needs samples (6 rounds; 1
// with JUSTONCE_BENCH_SMALL, which only keeps the benchmark from rotting).
func latencyRounds() int {
	if os.Getenv("JUSTONCE_BENCH_SMALL") != "" {
		return 1
	}
	return 6
}
