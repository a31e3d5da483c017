package outbox_test

import (
	"context"
	"os"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
)

// benchSmall is set by JUSTONCE_BENCH_SMALL=1: every benchmark does a few
// short rounds, so that CI runs them (numbers not meant to be read).
var benchSmall = os.Getenv("JUSTONCE_BENCH_SMALL") == "1"

func sized(full, small int) int {
	if benchSmall {
		return small
	}
	return full
}

// medianRatio is the median over rounds of base[r]/subject[r] (durations:
// subject's speed relative to base's).
func medianRatio(subject, base []time.Duration) float64 {
	xs := make([]float64, len(subject))
	for r := range subject {
		xs[r] = float64(base[r]) / float64(subject[r])
	}
	sort.Float64s(xs)
	if n := len(xs); n%2 == 1 {
		return xs[n/2]
	} else {
		return (xs[n/2-1] + xs[n/2]) / 2
	}
}

func total(ds []time.Duration) time.Duration {
	var t time.Duration
	for _, d := range ds {
		t += d
	}
	return t
}

// BenchmarkRelayThroughput: the relay draining a backlog of messages (100
// keys over a 4-partition topic) to Kafka, against the same messages
// written straight with a kafka-go Writer configured alike (RequireAll,
// batches of 500, 4 writers at once as the relay's 4 lanes at once), in
// interleaved rounds. ratio = relay / direct.
func BenchmarkRelayThroughput(b *testing.B) {
	fx := newFixture(b, 0)
	rounds, perRound := sized(4, 1), sized(20000, 500)
	const keys = 100
	value := make([]byte, 200)
	msgs := func(topic string) []outbox.Message {
		out := make([]outbox.Message, perRound)
		for i := range out {
			out[i] = outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("key-" + strconv.Itoa(i%keys)), Value: value}
		}
		return out
	}
	var relayT, directT []time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		for r := 0; r < rounds; r++ {
			b.StopTimer()
			topic := newTopic(b, fx.brokers, 4)
			ms := msgs(topic)
			for i := 0; i < len(ms); i += 1000 {
				fx.add(b, ms[i:min(i+1000, len(ms))]...)
			}
			direct := &kafka.Writer{Addr: kafka.TCP(fx.brokers...), Transport: &kafka.Transport{}, RequiredAcks: kafka.RequireAll,
				Balancer: kafka.Murmur2Balancer{}, BatchSize: 500, BatchTimeout: time.Millisecond}
			dtopic := newTopic(b, fx.brokers, 4)
			km := make([]kafka.Message, perRound)
			for i, m := range msgs(dtopic) {
				km[i] = kafka.Message{Topic: m.Topic, Key: m.Key, Value: m.Value,
					Headers: []kafka.Header{{Key: "ce_id", Value: []byte(strconv.Itoa(i))}}}
			}
			b.StartTimer()

			// The relay, from start to an empty outbox.
			w := &kafka.Writer{Addr: kafka.TCP(fx.brokers...), Transport: &kafka.Transport{}}
			var published atomic.Int64
			done := make(chan struct{})
			rl2, err := fx.ob.Relay(outbox.RelayConfig{Publishers: publishers(kafkaOn(b, w), nil), Hooks: outbox.RelayHooks{OnPublished: func(_ outbox.Broker, _, k int) {
				if published.Add(int64(k)) == int64(perRound) {
					close(done)
				}
			}}})
			require.NoError(b, err)
			ctx, cancel := context.WithCancel(context.Background())
			stopped := make(chan error, 1)
			start := time.Now()
			go func() { stopped <- rl2.Run(ctx) }()
			<-done
			relayT = append(relayT, time.Since(start))
			cancel()
			require.NoError(b, <-stopped)
			_ = w.Close()

			// Direct: the same messages, in batches of 500, 4 at once.
			start = time.Now()
			var wg sync.WaitGroup
			var werr atomic.Value
			next := atomic.Int64{}
			for range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						i := int(next.Add(500)) - 500
						if i >= len(km) {
							return
						}
						if err := direct.WriteMessages(context.Background(), km[i:min(i+500, len(km))]...); err != nil {
							werr.Store(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			directT = append(directT, time.Since(start))
			require.Nil(b, werr.Load())
			_ = direct.Close()
		}
	}
	b.StopTimer()
	n := float64(len(relayT) * perRound)
	b.ReportMetric(n/total(directT).Seconds(), "direct-msgs/s")
	b.ReportMetric(n/total(relayT).Seconds(), "relay-msgs/s")
	b.ReportMetric(medianRatio(relayT, directT), "ratio")
}

// BenchmarkHandlerWithOutbox: a ledger handler that writes one row, run
// by 8 goroutines, against the same handler that also adds one outbox
// message (with the NOTIFY trigger, as shipped), and the same with the
// trigger disabled (what NOTIFY costs), interleaved. ratio = with outbox
// / without.
func BenchmarkHandlerWithOutbox(b *testing.B) {
	fx := newFixture(b, 0)
	fx.pg.Exec(b, `CREATE TABLE effects (id text NOT NULL, v bigint)`)
	ledger, err := inbox.New(fx.pg.Pool, inbox.Config{})
	require.NoError(b, err)
	rounds, perRound, workers := sized(6, 1), sized(3000, 50), 8
	run := func(tag string, round int, withOutbox bool) time.Duration {
		var next atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= perRound {
						return
					}
					id := tag + "-" + strconv.Itoa(round) + "-" + strconv.Itoa(i)
					_, err := ledger.Do(context.Background(), inbox.Request{Key: inbox.Key{Scope: "bench", ID: id}}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
						if _, err := tx.Exec(ctx, `INSERT INTO effects (id, v) VALUES ($1, $2)`, id, i); err != nil {
							return inbox.Result{}, err
						}
						if withOutbox {
							if _, err := fx.ob.Add(ctx, tx, outbox.Message{Broker: outbox.Kafka, Topic: "t", Key: []byte(id), Value: []byte("v")}); err != nil {
								return inbox.Result{}, err
							}
						}
						return inbox.Result{}, nil
					})
					if err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		return time.Since(start)
	}
	var without, with, quiet []time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		for r := 0; r < rounds; r++ {
			round := n*rounds + r
			for k := range 3 {
				switch (r + k) % 3 {
				case 0:
					without = append(without, run("plain", round, false))
				case 1:
					with = append(with, run("outbox", round, true))
				case 2:
					fx.pg.Exec(b, `ALTER TABLE outbox DISABLE TRIGGER outbox_notify`)
					quiet = append(quiet, run("quiet", round, true))
					fx.pg.Exec(b, `ALTER TABLE outbox ENABLE TRIGGER outbox_notify`)
				}
			}
			fx.pg.Exec(b, `DELETE FROM outbox`)
		}
	}
	b.StopTimer()
	k := float64(len(with) * perRound)
	b.ReportMetric(k/total(without).Seconds(), "base-ops/s")
	b.ReportMetric(k/total(with).Seconds(), "ops/s")
	b.ReportMetric(k/total(quiet).Seconds(), "no-notify-ops/s")
	b.ReportMetric(medianRatio(with, without), "ratio")
	b.ReportMetric(medianRatio(quiet, without), "no-notify-ratio")
}

// BenchmarkIdleLatency: an idle relay (poll interval one hour: only the
// commit's NOTIFY wakes it), one message committed at a time; the time
// from the commit's return to the relay's report that the broker acked
// it (after the deletion committed: an upper bound). Reports p50 and p99,
// beside those of the same message written straight with a kafka-go
// Writer configured alike (RequireAll), interleaved.
func BenchmarkIdleLatency(b *testing.B) {
	fx := newFixture(b, 0)
	topic := newTopic(b, fx.brokers, 1)
	acked := make(chan time.Time, 1)
	w := &kafka.Writer{Addr: kafka.TCP(fx.brokers...), Transport: &kafka.Transport{}}
	b.Cleanup(func() { _ = w.Close() })
	direct := &kafka.Writer{Addr: kafka.TCP(fx.brokers...), Transport: &kafka.Transport{}, RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	b.Cleanup(func() { _ = direct.Close() })
	fx.relay(b, outbox.RelayConfig{Publishers: publishers(kafkaOn(b, w), nil), PollInterval: time.Hour, Hooks: outbox.RelayHooks{
		OnPublished: func(outbox.Broker, int, int) { acked <- time.Now() },
	}})
	testsvc.Eventually(b, 30*time.Second, func() bool { return listening(b, fx) }, "relay listening")
	// Warm up the writers' connections.
	fx.add(b, outbox.Message{Broker: outbox.Kafka, Topic: topic, Value: []byte("warm")})
	<-acked
	require.NoError(b, direct.WriteMessages(context.Background(), kafka.Message{Topic: topic, Value: []byte("warm")}))
	samples := sized(300, 20)
	var lat, dlat []time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		for i := 0; i < samples; i++ {
			fx.add(b, outbox.Message{Broker: outbox.Kafka, Topic: topic, Value: []byte("x")})
			committed := time.Now()
			select {
			case at := <-acked:
				lat = append(lat, at.Sub(committed))
			case <-time.After(30 * time.Second):
				b.Fatal("no ack")
			}
			time.Sleep(5 * time.Millisecond) // idle between messages
			start := time.Now()
			require.NoError(b, direct.WriteMessages(context.Background(), kafka.Message{Topic: topic, Value: []byte("x")}))
			dlat = append(dlat, time.Since(start))
			time.Sleep(5 * time.Millisecond)
		}
	}
	b.StopTimer()
	pct := func(ds []time.Duration, p float64) float64 {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		return float64(ds[int(p*float64(len(ds)-1))].Microseconds()) / 1000
	}
	b.ReportMetric(pct(lat, 0.50), "p50-ms")
	b.ReportMetric(pct(lat, 0.99), "p99-ms")
	b.ReportMetric(pct(dlat, 0.50), "direct-p50-ms")
	b.ReportMetric(pct(dlat, 0.99), "direct-p99-ms")
}
