package overload_test

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/kafkaadmin"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// The consumer's bottleneck: one partition, so one lane, whose handler
// holds its connection for perMessage: about 200 events a second.
const (
	perMessage  = 5 * time.Millisecond
	msgSize     = 16 << 10
	maxBuffered = 64
	// What the broker client holds besides the front's MaxBuffered: the
	// kafka-go reader's queue (queueCap messages), franz-go's buffered
	// fetch (clientBuf bytes).
	queueCap   = 16
	clientBuf  = queueCap * msgSize
	produceFor = 6 * time.Second
)

// liveHeap is the heap in use after a collection.
func liveHeap() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// Offered twice what its handler can take, a Kafka consumer falls behind
// with its memory flat: fetching pauses while MaxBuffered messages wait,
// so the backlog stays in the broker. Its live heap, measured a third of
// the way into the load and at its end, grows by less than MaxBuffered
// messages, while the backlog grows by hundreds; then it drains the
// backlog, every event once. Both Kafka fronts: kafkainbox (kafka-go) and
// franzinbox (franz-go).
func TestOverloadKafkaConsumerMemoryFlat(t *testing.T) {
	t.Run("kafkainbox", func(t *testing.T) {
		consumerMemoryFlat(t, func(brokers []string, topic string, p consumer.Config, h consumer.Handler) (runner, error) {
			return kafkainbox.New(kafkainbox.Config{
				Brokers: brokers, Topic: topic, GroupID: topic, Processor: p,
				Scheduling: consumer.Scheduling{MaxBuffered: maxBuffered},
				Reader: func(rc *kafka.ReaderConfig) {
					rc.QueueCapacity = queueCap
					rc.MaxWait = 300 * time.Millisecond
					rc.StartOffset = kafka.FirstOffset
				},
			}, h)
		})
	})
	t.Run("franzinbox", func(t *testing.T) {
		consumerMemoryFlat(t, func(brokers []string, topic string, p consumer.Config, h consumer.Handler) (runner, error) {
			return franzinbox.New(franzinbox.Config{
				Brokers: brokers, Topics: []string{topic}, GroupID: topic, Processor: p,
				Scheduling: consumer.Scheduling{MaxBuffered: maxBuffered},
				ClientOptions: []kgo.Opt{kgo.FetchMaxWait(300 * time.Millisecond),
					kgo.FetchMaxBytes(clientBuf), kgo.FetchMaxPartitionBytes(clientBuf)},
			}, h)
		})
	})
}

// runner is a consumer front's Consumer.
type runner interface{ Run(context.Context) error }

// bound is what the consumer may hold: MaxBuffered messages in its lanes,
// and the broker client's own buffer.
const bound = maxBuffered*msgSize + clientBuf

func consumerMemoryFlat(t *testing.T, newConsumer func(brokers []string, topic string, p consumer.Config, h consumer.Handler) (runner, error)) {
	brokers := testsvc.KafkaBrokers(t)
	topic := testsvc.Unique("overload")
	require.NoError(t, kafkaadmin.CreateTopic(brokers[0], topic, 1))
	require.NoError(t, kafkaadmin.CreateTopic(brokers[0], topic+kafkainbox.DeadLetterSuffix, 1))
	if franzinbox.DeadLetterSuffix != kafkainbox.DeadLetterSuffix {
		require.NoError(t, kafkaadmin.CreateTopic(brokers[0], topic+franzinbox.DeadLetterSuffix, 1))
	}

	pg := testsvc.Postgres(t, testsvc.MaxConns(4))
	pg.Exec(t, `CREATE TABLE effects (key text NOT NULL, n bigserial)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	var executed atomic.Int64
	c, err := newConsumer(brokers, topic, consumer.Config{Ledger: l, Hooks: consumer.Hooks{
		// Counted once committed.
		OnOutcome: func(_ *consumer.Message, out inbox.Outcome, _ time.Duration) {
			if out.Disposition == inbox.Executed {
				executed.Add(1)
			}
		},
	}}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if _, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, m.ID); err != nil {
			return err
		}
		time.Sleep(perMessage)
		return nil
	})
	require.NoError(t, err)
	stop, _ := consumertest.Start(t, c)
	defer stop()

	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, BatchSize: 100, BatchBytes: 768 << 10,
		BatchTimeout: time.Millisecond, RequiredAcks: kafka.RequireAll, Transport: &kafka.Transport{}}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The first events, to see the consumer running before the load.
	value := make([]byte, msgSize)
	produced := 0
	send := func(n int) {
		batch := make([]kafka.Message, n)
		for i := range batch {
			batch[i] = kafkainbox.NewMessage(fmt.Sprintf("e-%d", produced+i), nil, value)
		}
		require.NoError(t, w.WriteMessages(ctx, batch...))
		produced += n
	}
	send(10)
	testsvc.Eventually(t, time.Minute, func() bool { return executed.Load() == 10 }, "the consumer runs")

	// Twice what it takes: 2/perMessage a second, in batches every 100 ms.
	perTick := int(2 * (100 * time.Millisecond) / perMessage)
	type sample struct {
		at            time.Duration
		heap, backlog int64
	}
	var samples []sample
	start := time.Now()
	tick := time.NewTicker(100 * time.Millisecond)
	for i := 0; time.Since(start) < produceFor; i++ {
		send(perTick)
		if i == int(produceFor/(100*time.Millisecond))/3 || time.Since(start)+100*time.Millisecond >= produceFor {
			samples = append(samples, sample{time.Since(start), int64(liveHeap()), int64(produced) - executed.Load()})
		}
		<-tick.C
	}
	tick.Stop()
	offered := float64(produced-10) / time.Since(start).Seconds()
	a, b := samples[0], samples[len(samples)-1]
	taken := float64(executed.Load()-10) / time.Since(start).Seconds()
	t.Logf("overload %s: offered %.0f events/s of %d KiB, taken %.0f/s; at %s live heap %.1f MiB, backlog %d; at %s live heap %.1f MiB, backlog %d; "+
		"growth %+.2f MiB, bound MaxBuffered x size + the client's buffer = %.2f MiB",
		t.Name(), offered, msgSize>>10, taken, a.at.Round(time.Millisecond), mib(a.heap), a.backlog, b.at.Round(time.Millisecond), mib(b.heap), b.backlog,
		mib(b.heap-a.heap), mib(bound))
	require.Greater(t, offered, 1.5*taken, "the load was not twice what the consumer takes")
	require.Greater(t, b.backlog-a.backlog, int64(4*maxBuffered), "the backlog did not grow: the consumer kept up")
	require.Less(t, b.heap-a.heap, int64(bound), "the live heap grew with the backlog")

	testsvc.Eventually(t, 2*time.Minute, func() bool { return executed.Load() >= int64(produced) }, "the backlog drains")
	require.Equal(t, produced, pg.Count(t, `SELECT count(*) FROM effects`), "effects (doubled if more, lost if fewer)")
	require.Equal(t, produced, pg.Count(t, `SELECT count(DISTINCT key) FROM effects`), "distinct effects")
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }
