package natsinbox

import (
	"context"
	"fmt"
	"os"
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
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// benchEvents is how many events each side consumes per round of
// BenchmarkWrappedVsBare; benchPaced how many one-at-a-time events each
// side answers per round of BenchmarkLatencyLowLoad.
const (
	benchEvents = 3000
	benchPaced  = 300
)

// BenchmarkWrappedVsBare sizes its own work: each iteration is a round in
// which a bare JetStream consumer (Consume, BEGIN / business INSERT /
// COMMIT, Ack, one message at a time per worker) and the natsinbox
// consumer doing the same business INSERT with the ledger each consume
// benchEvents pre-published events, same concurrency and prefetch, in
// alternating order. It reports the medians over rounds of both rates and
// of the paired ratios (per round, neighbours in time: the machine's load
// drifts). The default config batches adaptively; BatchSize 1 is the
// per-event mode; both are measured against the same bare per-event
// consumer.
//
//	go test -run '^$' -bench WrappedVsBare -benchtime 3x ./transports/natsinbox/
func BenchmarkWrappedVsBare(b *testing.B) {
	for _, tc := range []struct {
		name        string
		concurrency int
		batch       int
	}{
		{"default", 1, 0},
		{"per_event", 1, 1},
		{"default_conc=4", 4, 0},
	} {
		b.Run(tc.name, func(b *testing.B) {
			e := newEnv(b)
			pg := testsvc.Postgres(b, testsvc.MaxConns(8))
			pg.Exec(b, `CREATE TABLE bench_effects (event_id text NOT NULL, value bytea)`)
			ledger, err := inbox.New(pg.Pool, inbox.Config{})
			if err != nil {
				b.Fatal(err)
			}
			var bare, wrapped, ratio []float64
			for round := 0; round < b.N; round++ {
				var tb, tw time.Duration
				if round%2 == 0 {
					tb = benchBare(b, e, pg.Pool, benchEvents, tc.concurrency)
					tw = benchWrapped(b, e, ledger, benchEvents, tc.concurrency, tc.batch)
				} else {
					tw = benchWrapped(b, e, ledger, benchEvents, tc.concurrency, tc.batch)
					tb = benchBare(b, e, pg.Pool, benchEvents, tc.concurrency)
				}
				bare = append(bare, benchEvents/tb.Seconds())
				wrapped = append(wrapped, benchEvents/tw.Seconds())
				ratio = append(ratio, tb.Seconds()/tw.Seconds())
				b.Logf("round %d: bare %v wrapped %v", round, tb, tw)
			}
			b.ReportMetric(median(bare), "bare-ev/s")
			b.ReportMetric(median(wrapped), "wrapped-ev/s")
			b.ReportMetric(median(ratio), "wrapped/bare")
		})
	}
}

// BenchmarkLatencyLowLoad sizes its own work: each iteration is a round in
// which benchPaced events are published one at a time, each after the
// previous one was handled, to a bare consumer and to a natsinbox consumer
// with the defaults; the latency from before the publish to the handler's
// commit is measured. It reports p50 and p99 of each and the p99 ratio
// (target ≤ 1.2: batching adds no latency when nothing else is waiting).
//
//	go test -run '^$' -bench LatencyLowLoad -benchtime 1x ./transports/natsinbox/
func BenchmarkLatencyLowLoad(b *testing.B) {
	e := newEnv(b)
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, `CREATE TABLE bench_effects (event_id text NOT NULL, value bytea)`)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	if err != nil {
		b.Fatal(err)
	}
	var bare, wrapped []time.Duration
	for round := 0; round < b.N*latencyRounds(); round++ {
		if round%2 == 0 {
			bare = append(bare, pacedLatency(b, e, pg.Pool, nil)...)
			wrapped = append(wrapped, pacedLatency(b, e, pg.Pool, ledger)...)
		} else {
			wrapped = append(wrapped, pacedLatency(b, e, pg.Pool, ledger)...)
			bare = append(bare, pacedLatency(b, e, pg.Pool, nil)...)
		}
	}
	pb, pw := quantile(bare, 99), quantile(wrapped, 99)
	b.ReportMetric(float64(quantile(bare, 50).Microseconds())/1000, "p50-bare-ms")
	b.ReportMetric(float64(quantile(wrapped, 50).Microseconds())/1000, "p50-wrapped-ms")
	b.ReportMetric(float64(pb.Microseconds())/1000, "p99-bare-ms")
	b.ReportMetric(float64(pw.Microseconds())/1000, "p99-wrapped-ms")
	b.ReportMetric(float64(pw)/float64(pb), "p99-wrapped/bare")
}

// quantile is the q-th percentile of ds.
func quantile(ds []time.Duration, q int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[(len(s)*q-1)/100]
}

// pacedLatency publishes benchPaced events one at a time to a fresh
// stream, each after the previous one was handled, and returns each
// latency from before the publish to the handler's commit: a bare
// consumer when ledger is nil, else a natsinbox consumer with the
// defaults.
func pacedLatency(b *testing.B, e *env, pool *pgxpool.Pool, ledger *inbox.Ledger) []time.Duration {
	subject := testsvc.Unique("lat")
	stream := e.stream(b, subject, 0)
	ctx, cancel := context.WithCancel(context.Background())
	handled := make(chan struct{}, 1)
	stopped := make(chan struct{})
	insert := func(ctx context.Context, tx pgx.Tx, id string, v []byte) error {
		_, err := tx.Exec(ctx, benchInsert, id, v)
		return err
	}
	if ledger != nil {
		ready := make(chan struct{})
		c, err := New(Config{
			Conn: e.nc, Stream: stream, Durable: "lat",
			Processor: consumer.Config{Ledger: ledger, Scope: stream, Hooks: consumer.Hooks{
				OnOutcome: func(*consumer.Message, inbox.Outcome, time.Duration) { handled <- struct{}{} },
			}},
			ready: func() { close(ready) },
		}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return insert(ctx, tx, m.ID, m.Value)
		})
		if err != nil {
			b.Fatal(err)
		}
		go func() {
			defer close(stopped)
			_ = c.Run(ctx)
		}()
		<-ready
	} else {
		cons, err := e.js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
			Durable: "lat", AckPolicy: jetstream.AckExplicitPolicy, AckWait: DefaultAckWait, MaxDeliver: -1,
		})
		if err != nil {
			b.Fatal(err)
		}
		cc, err := cons.Consume(func(m jetstream.Msg) {
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return insert(ctx, tx, m.Headers().Get(jetstream.MsgIDHeader), m.Data())
			}); err != nil {
				_ = m.Nak()
				return
			}
			_ = m.Ack()
			handled <- struct{}{}
		}, jetstream.PullMaxMessages(DefaultMaxBuffered))
		if err != nil {
			b.Fatal(err)
		}
		go func() {
			defer close(stopped)
			<-ctx.Done()
			cc.Stop()
		}()
	}
	defer func() {
		cancel()
		<-stopped
	}()
	out := make([]time.Duration, 0, benchPaced)
	for i := -1; i < benchPaced; i++ { // event -1 warms up, unmeasured
		m := nats.NewMsg(subject)
		m.Header.Set(jetstream.MsgIDHeader, subject+"-"+strconv.Itoa(i))
		m.Data = []byte(`{"amount":100,"currency":"EUR"}`)
		start := time.Now()
		if _, err := e.js.PublishMsg(ctx, m); err != nil {
			b.Fatal(err)
		}
		select {
		case <-handled:
		case <-time.After(30 * time.Second):
			b.Fatal("a paced event was not handled within 30 s")
		}
		if i >= 0 {
			out = append(out, time.Since(start))
		}
	}
	return out
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
	start := time.Now()
	cc, err := cons.Consume(func(m jetstream.Msg) { jobs <- m }, jetstream.PullMaxMessages(DefaultMaxBuffered))
	if err != nil {
		b.Fatal(err)
	}
	<-fin
	took := time.Since(start)
	cc.Stop()
	close(jobs)
	wg.Wait()
	return took
}

// benchWrapped consumes n events with natsinbox.
func benchWrapped(b *testing.B, e *env, ledger *inbox.Ledger, n, concurrency, batch int) time.Duration {
	stream := benchStream(b, e, n)
	fin := make(chan struct{})
	var done atomic.Int64
	ready := make(chan struct{})
	var start time.Time
	c, err := New(Config{
		Conn: e.nc, Stream: stream, Durable: "wrapped", Scheduling: consumer.Scheduling{Concurrency: concurrency, BatchSize: batch},
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
	case err := <-errc:
		b.Fatal(err)
	}
	<-fin
	took := time.Since(start)
	cancel()
	if err := <-errc; err != nil {
		b.Fatal(fmt.Errorf("Run: %w", err))
	}
	return took
}

func median(xs []float64) float64 {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
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
