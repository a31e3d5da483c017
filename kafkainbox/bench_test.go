package kafkainbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/kafkainbox"
)

// BenchmarkConsumer consumes the same 5,000 events (4 partitions) with:
//   - bare: a plain kafka-go group reader, one message at a time, the
//     business INSERT in its own transaction, offsets committed every second;
//   - ledger_loop: the same loop calling inbox.Ledger.Do around the INSERT
//     (the ledger without this package);
//   - wrapped: a Consumer with the defaults (one message at a time, the same
//     INSERT in the ledger's transaction, offsets committed every second);
//   - wrapped_c4: the same with Concurrency 4 (ordered by partition);
//   - batch: a Consumer with BatchSize 100.
//
// Each is timed from its first message to its last commit, with a fresh
// group and empty tables. It reports events/s of each and the ratios
// wrapped/bare (target ≥ 0.85) and batch/wrapped. Run with
// -benchtime=Nx to average N rounds.
func BenchmarkConsumer(b *testing.B) {
	brokers := testsvc.KafkaBrokers(b)
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, `CREATE TABLE effects (event_id text NOT NULL, value bytea)`)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	const n = 5000
	topic := newTopic(b, brokers, 4)
	publish(b, brokers, topic, events("bench", 0, n, 64)...)

	insert := func(ctx context.Context, tx pgx.Tx, id string, v []byte) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, id, v)
		return err
	}
	reset := func() {
		pg.Exec(b, `TRUNCATE effects, processed_events`)
	}

	// loop is a kafka-go loop like bare, with the ledger's Do around the
	// INSERT but without this package: wrapped/ledger_loop is the adapter's
	// own cost, ledger_loop/bare the ledger's.
	loop := func(useLedger bool) time.Duration {
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
			id, _ := consumer.DefaultID(&consumer.Message{Headers: []consumer.Header{{Key: m.Headers[0].Key, Value: m.Headers[0].Value}}})
			if useLedger {
				_, err = ledger.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "bench", ID: id}, Source: kafkainbox.Source},
					func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
						return inbox.Result{}, insert(ctx, tx, id, m.Value)
					})
			} else {
				err = pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error { return insert(ctx, tx, id, m.Value) })
			}
			require.NoError(b, err)
			require.NoError(b, r.CommitMessages(ctx, m))
		}
		return time.Since(first)
	}
	bare := func() time.Duration { return loop(false) }

	wrapped := func(concurrency, batch int) time.Duration {
		var first atomic.Pointer[time.Time]
		var done atomic.Int64
		finished := make(chan time.Time, 1)
		c, err := kafkainbox.New(kafkainbox.Config{
			Brokers: brokers, Topic: topic, GroupID: testsvc.Unique("wrapped"),
			Concurrency: concurrency, BatchSize: batch,
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

	var tBare, tLoop, tWrapped, tC4, tBatch time.Duration
	for i := 0; i < b.N; i++ {
		// Alternate the order of the per-event variants, against drift in
		// the machine's load.
		runs := []func(){
			func() { tBare += bare() },
			func() { tLoop += loop(true) },
			func() {
				tWrapped += wrapped(1, 0)
				require.Equal(b, n, pg.Count(b, `SELECT count(*) FROM effects`))
			},
		}
		for j := range runs {
			if i%2 == 1 {
				j = len(runs) - 1 - j
			}
			reset()
			runs[j]()
		}
		reset()
		tC4 += wrapped(4, 0)
		reset()
		tBatch += wrapped(1, 100)
		require.Equal(b, n, pg.Count(b, `SELECT count(*) FROM effects`))
	}
	rate := func(d time.Duration) float64 { return float64(n*b.N) / d.Seconds() }
	b.ReportMetric(float64(tWrapped.Nanoseconds())/float64(n*b.N), "ns/op") // per wrapped event
	b.ReportMetric(rate(tBare), "bare_ev/s")
	b.ReportMetric(rate(tLoop), "ledger_loop_ev/s")
	b.ReportMetric(rate(tWrapped)/rate(tLoop), "wrapped/ledger_loop")
	b.ReportMetric(rate(tWrapped), "wrapped_ev/s")
	b.ReportMetric(rate(tC4), "wrapped_c4_ev/s")
	b.ReportMetric(rate(tBatch), "batch_ev/s")
	b.ReportMetric(rate(tWrapped)/rate(tBare), "wrapped/bare")
	b.ReportMetric(rate(tBatch)/rate(tWrapped), "batch/wrapped")
}
