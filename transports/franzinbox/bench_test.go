package franzinbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// benchEvents is how many events each variant consumes per round of
// BenchmarkConsumer.
const benchEvents = 5000

// BenchmarkConsumer sizes its own work: each iteration (round) consumes
// the same benchEvents events (4 partitions, 64-byte payloads), from a
// fresh group and empty tables, with:
//   - bare: a plain franz-go group consumer, read committed, the business
//     INSERT of each record in its own transaction (BEGIN; INSERT;
//     COMMIT), the offsets of each poll committed after it;
//   - franz: a franzinbox Consumer with the defaults (one at a time; the
//     messages of a partition already waiting, up to 50, run in one
//     transaction, each as if in a savepoint of its own), the same INSERT in the ledger's
//     transaction;
//   - franz_per_event: the same with BatchSize 1 (one message, one
//     transaction);
//   - franz_c4: the defaults with Concurrency 4;
//   - kafkainbox: a kafkainbox Consumer (kafka-go) with its defaults, which
//     are the same, the same INSERT;
//
// each timed from its first message to its last. The order of the variants
// alternates between rounds, against drift in the machine's load. Metrics:
// events/s of each and their ratios to bare, and franz/kafkainbox.
// -benchtime=Nx runs N rounds (one round is enough to read the ratios; more
// average the noise).
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
		cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumerGroup(testsvc.Unique("bare")), kgo.ConsumeTopics(topic),
			kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.DisableAutoCommit())
		require.NoError(b, err)
		defer cl.Close()
		ctx := context.Background()
		var first time.Time
		for i := 0; i < n; {
			fs := cl.PollFetches(ctx)
			require.Empty(b, fs.Errors())
			if i == 0 && !fs.Empty() {
				first = time.Now()
			}
			for it := fs.RecordIter(); !it.Done(); i++ {
				r := it.Next()
				id := string(r.Headers[0].Value)
				require.NoError(b, pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error { return insert(ctx, tx, id, r.Value) }))
			}
			require.NoError(b, cl.CommitUncommittedOffsets(ctx))
		}
		return time.Since(first)
	}

	// timed runs a consumer until n events were answered, timed from the
	// first handler call.
	timed := func(newConsumer func(consumer.Config, consumer.Handler) interface{ Run(context.Context) error }) time.Duration {
		var first atomic.Pointer[time.Time]
		var done atomic.Int64
		finished := make(chan time.Time, 1)
		c := newConsumer(consumer.Config{Ledger: ledger, Hooks: consumer.Hooks{
			OnOutcome: func(*consumer.Message, inbox.Outcome, time.Duration) {
				if done.Add(1) == n {
					finished <- time.Now()
				}
			},
		}}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if first.Load() == nil {
				now := time.Now()
				first.CompareAndSwap(nil, &now)
			}
			return insert(ctx, tx, m.ID, m.Value)
		})
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		go func() { ran <- c.Run(ctx) }()
		end := <-finished
		cancel()
		require.NoError(b, <-ran)
		require.Equal(b, n, pg.Count(b, `SELECT count(*) FROM effects`))
		return end.Sub(*first.Load())
	}
	franz := func(concurrency, batch int) func() time.Duration {
		return func() time.Duration {
			return timed(func(pc consumer.Config, h consumer.Handler) interface{ Run(context.Context) error } {
				c, err := franzinbox.New(franzinbox.Config{
					Brokers: brokers, Topics: []string{topic}, GroupID: testsvc.Unique("franz"),
					Scheduling: consumer.Scheduling{Concurrency: concurrency, BatchSize: batch}, Processor: pc,
				}, h)
				require.NoError(b, err)
				return c
			})
		}
	}
	kafkaGo := func() time.Duration {
		return timed(func(pc consumer.Config, h consumer.Handler) interface{ Run(context.Context) error } {
			c, err := kafkainbox.New(kafkainbox.Config{
				Brokers: brokers, Topic: topic, GroupID: testsvc.Unique("kafkainbox"), Processor: pc,
			}, h)
			require.NoError(b, err)
			return c
		})
	}

	variants := []struct {
		name string
		run  func() time.Duration
		took time.Duration
	}{
		{name: "bare", run: bare},
		{name: "franz", run: franz(0, 0)},
		{name: "franz_per_event", run: franz(0, 1)},
		{name: "franz_c4", run: franz(4, 0)},
		{name: "kafkainbox", run: kafkaGo},
	}
	for i := 0; i < b.N; i++ {
		for j := range variants {
			if i%2 == 1 {
				j = len(variants) - 1 - j
			}
			reset()
			variants[j].took += variants[j].run()
		}
	}
	rate := map[string]float64{}
	for _, v := range variants {
		rate[v.name] = float64(n*b.N) / v.took.Seconds()
		b.ReportMetric(rate[v.name], v.name+"_ev/s")
	}
	b.ReportMetric(float64(variants[1].took.Nanoseconds())/float64(n*b.N), "ns/op") // per franz event
	for _, name := range []string{"franz", "franz_per_event", "franz_c4", "kafkainbox"} {
		b.ReportMetric(rate[name]/rate["bare"], name+"/bare")
	}
	b.ReportMetric(rate["franz"]/rate["kafkainbox"], "franz/kafkainbox")
}
