package natsinbox

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
)

// BenchmarkWrappedVsBare measures, in one run, a bare JetStream consumer
// (Consume, BEGIN / business INSERT / COMMIT, Ack) against the natsinbox
// consumer doing the same business INSERT with the ledger, same
// concurrency and prefetch, each on b.N pre-published events per round, in
// benchRounds paired rounds. It reports the medians of both rates and of
// the paired ratios; batch mode is measured against the same bare
// per-event consumer.
//
//	go test -run '^$' -bench WrappedVsBare -benchtime 4000x ./natsinbox/
func BenchmarkWrappedVsBare(b *testing.B) {
	for _, tc := range []struct {
		name        string
		concurrency int
		batch       int
	}{
		{"conc=1", 1, 0},
		{"conc=4", 4, 0},
		{"batch=100", 1, 100},
	} {
		b.Run(tc.name, func(b *testing.B) {
			e := newEnv(b)
			pg := testsvc.Postgres(b, testsvc.MaxConns(8))
			pg.Exec(b, `CREATE TABLE bench_effects (event_id text NOT NULL, value bytea)`)
			ledger, err := inbox.New(pg.Pool, inbox.Config{})
			if err != nil {
				b.Fatal(err)
			}
			// Paired rounds, the order alternating: the machine's load
			// drifts (other processes share its two cores), so each ratio
			// compares neighbours in time and the medians are reported.
			var bare, wrapped, ratio []float64
			b.ResetTimer()
			for round := 0; round < benchRounds; round++ {
				var tb, tw time.Duration
				if round%2 == 0 {
					tb = benchBare(b, e, pg.Pool, b.N, tc.concurrency)
					tw = benchWrapped(b, e, ledger, b.N, tc.concurrency, tc.batch)
				} else {
					tw = benchWrapped(b, e, ledger, b.N, tc.concurrency, tc.batch)
					tb = benchBare(b, e, pg.Pool, b.N, tc.concurrency)
				}
				bare = append(bare, float64(b.N)/tb.Seconds())
				wrapped = append(wrapped, float64(b.N)/tw.Seconds())
				ratio = append(ratio, tb.Seconds()/tw.Seconds())
				b.Logf("round %d: bare %v wrapped %v", round, tb, tw)
			}
			b.StopTimer()
			b.ReportMetric(median(bare), "bare-ev/s")
			b.ReportMetric(median(wrapped), "wrapped-ev/s")
			b.ReportMetric(median(ratio), "wrapped/bare")
		})
	}
}

// benchRounds is how many bare/wrapped pairs one benchmark runs.
const benchRounds = 5

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// benchStream creates a stream with n messages, each with its own
// Nats-Msg-Id, and returns its name.
func benchStream(b *testing.B, e *env, n int) string {
	subject := testsvc.Unique("bench")
	stream := e.stream(b, subject, 0)
	for i := 0; i < n; i++ {
		m := nats.NewMsg(subject)
		m.Header.Set(jetstream.MsgIDHeader, subject+"-"+strconv.Itoa(i))
		m.Data = []byte(`{"amount":100,"currency":"EUR"}`)
		if _, err := e.js.PublishMsgAsync(m); err != nil {
			b.Fatal(err)
		}
	}
	select {
	case <-e.js.PublishAsyncComplete():
	case <-time.After(time.Minute):
		b.Fatal("publish did not complete")
	}
	return stream
}

const benchInsert = `INSERT INTO bench_effects (event_id, value) VALUES ($1, $2)`

// benchBare consumes n events the way one would without justonce.
func benchBare(b *testing.B, e *env, pool *pgxpool.Pool, n, concurrency int) time.Duration {
	b.StopTimer()
	stream := benchStream(b, e, n)
	ctx := context.Background()
	cons, err := e.js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable: "bare", AckPolicy: jetstream.AckExplicitPolicy, AckWait: DefaultAckWait, MaxDeliver: -1,
	})
	if err != nil {
		b.Fatal(err)
	}
	jobs := make(chan jetstream.Msg)
	fin := make(chan struct{})
	var done atomic.Int64
	var wg sync.WaitGroup
	for range concurrency {
		wg.Go(func() {
			for m := range jobs {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, benchInsert, m.Headers().Get(jetstream.MsgIDHeader), m.Data())
					return err
				})
				if err != nil {
					b.Error(err)
					_ = m.Nak()
					continue
				}
				_ = m.Ack()
				if done.Add(1) == int64(n) {
					close(fin)
				}
			}
		})
	}
	b.StartTimer()
	start := time.Now()
	cc, err := cons.Consume(func(m jetstream.Msg) { jobs <- m }, jetstream.PullMaxMessages(DefaultMaxBuffered))
	if err != nil {
		b.Fatal(err)
	}
	<-fin
	took := time.Since(start)
	b.StopTimer()
	cc.Stop()
	close(jobs)
	wg.Wait()
	return took
}

// benchWrapped consumes n events with natsinbox.
func benchWrapped(b *testing.B, e *env, ledger *inbox.Ledger, n, concurrency, batch int) time.Duration {
	b.StopTimer()
	stream := benchStream(b, e, n)
	fin := make(chan struct{})
	var done atomic.Int64
	ready := make(chan struct{})
	var start time.Time
	c, err := New(Config{
		Conn: e.nc, Stream: stream, Durable: "wrapped", Concurrency: concurrency, BatchSize: batch,
		Processor: consumer.Config{Ledger: ledger, Scope: stream, Hooks: consumer.Hooks{
			OnOutcome: func(*consumer.Message, inbox.Outcome, time.Duration) {
				if done.Add(1) == int64(n) {
					close(fin)
				}
			},
		}},
		ready: func() {
			start = time.Now()
			close(ready)
		},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, benchInsert, m.ID, m.Value)
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	select {
	case <-ready:
		b.StartTimer()
	case err := <-errc:
		b.Fatal(err)
	}
	<-fin
	took := time.Since(start)
	b.StopTimer()
	cancel()
	if err := <-errc; err != nil {
		b.Fatal(fmt.Errorf("Run: %w", err))
	}
	return took
}
