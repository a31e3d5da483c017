package overload_test

import (
	"context"
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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
	"github.com/justonce/justonce/transports/natsinbox"
)

// The NATS server of the NATS cases runs in a child process (the test
// binary again), so that its heap is not the consumer's.
func init() { testsvc.NATSProcessChild() }

// The consumer's bottleneck: one lane (one partition; Concurrency 1 on
// NATS), whose handler holds its connection for perMessage: about 200
// events a second, in batches of up to batchSize messages.
const (
	perMessage  = 5 * time.Millisecond
	msgSize     = 16 << 10
	maxBuffered = 64
	batchSize   = 16
	// What the broker clients hold besides the front's lanes: the kafka-go
	// reader's queue of queueCap messages, the one its reader holds
	// waiting for room in the queue and the one the front's fetch loop
	// holds waiting for room in the lanes; franz-go's buffered fetch of
	// fetchBytes and the fetch polled before it, waiting for room in the
	// lanes, and a record batch as the producer wrote it (of up to
	// fetchBytes), which its records share; the NATS client's messages
	// pulled and not yet in the lanes, up to the pull's size, MaxBuffered
	// (natsinbox reserves room in its lanes before it takes a message from
	// the client, so the pulled messages wait in the client while the
	// lanes are full).
	queueCap      = 16
	fetchBytes    = queueCap * msgSize
	kafkaGoBuf    = (queueCap + 2) * msgSize
	franzGoBuf    = 3 * fetchBytes
	natsClientBuf = maxBuffered * msgSize
	produceFor    = 6 * time.Second
	tick          = 100 * time.Millisecond
	// slack is what the live heap may move by besides the buffers: the
	// runtime's, the pool's and the producer's own state between two
	// readings, and what each buffered message costs beside its payload
	// (0.5 to 1.2 KiB: the client's and the front's structures).
	slack = 768 << 10
)

// liveHeap is the heap in use after two collections: the second empties
// what sync.Pools kept through the first (the producers' buffers).
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// runner is a consumer front's Consumer.
type runner interface{ Run(context.Context) error }

// front is a consumer front on its broker: a fresh topic or stream of one
// lane, a producer to it, and the front's consumer of it.
type front struct {
	// send publishes the events ids, each of value, and returns once the
	// broker has them.
	send func(ctx context.Context, ids []string, value []byte) error
	// newConsumer returns the front's consumer, MaxBuffered maxBuffered.
	newConsumer func(p consumer.Config, h consumer.Handler) (runner, error)
	// clientBuf is what the broker client may hold besides MaxBuffered.
	clientBuf int64
}

// fronts are the three consumer fronts, each made for one test.
var fronts = []struct {
	name string
	make func(t *testing.T) front
}{
	{"kafkainbox", func(t *testing.T) front {
		brokers, topic := kafkaTopic(t)
		f := kafkaProducer(t, brokers, topic)
		f.clientBuf = kafkaGoBuf
		f.newConsumer = func(p consumer.Config, h consumer.Handler) (runner, error) {
			return kafkainbox.New(kafkainbox.Config{
				Brokers: brokers, Topic: topic, GroupID: topic, Processor: p,
				Scheduling: consumer.Scheduling{MaxBuffered: maxBuffered, BatchSize: batchSize},
				Reader: func(rc *kafka.ReaderConfig) {
					rc.QueueCapacity = queueCap
					rc.MaxWait = 300 * time.Millisecond
					rc.StartOffset = kafka.FirstOffset
				},
			}, h)
		}
		return f
	}},
	{"franzinbox", func(t *testing.T) front {
		brokers, topic := kafkaTopic(t)
		f := kafkaProducer(t, brokers, topic)
		f.clientBuf = franzGoBuf
		f.newConsumer = func(p consumer.Config, h consumer.Handler) (runner, error) {
			return franzinbox.New(franzinbox.Config{
				Brokers: brokers, Topics: []string{topic}, GroupID: topic, Processor: p,
				Scheduling: consumer.Scheduling{MaxBuffered: maxBuffered, BatchSize: batchSize},
				ClientOptions: []kgo.Opt{kgo.FetchMaxWait(300 * time.Millisecond),
					kgo.FetchMaxBytes(fetchBytes), kgo.FetchMaxPartitionBytes(fetchBytes)},
			}, h)
		}
		return f
	}},
	{"natsinbox", natsFront},
}

// kafkaTopic makes a topic of one partition, and its dead-letter topic.
func kafkaTopic(t *testing.T) (brokers []string, topic string) {
	brokers = testsvc.KafkaBrokers(t)
	topic = testsvc.Unique("overload")
	require.NoError(t, kafkaadmin.CreateTopic(brokers[0], topic, 1))
	require.NoError(t, kafkaadmin.CreateTopic(brokers[0], topic+kafkainbox.DeadLetterSuffix, 1))
	if franzinbox.DeadLetterSuffix != kafkainbox.DeadLetterSuffix {
		require.NoError(t, kafkaadmin.CreateTopic(brokers[0], topic+franzinbox.DeadLetterSuffix, 1))
	}
	return brokers, topic
}

// kafkaProducer is a front's send to topic, through one kafka-go writer.
func kafkaProducer(t *testing.T, brokers []string, topic string) front {
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, BatchSize: 100, BatchBytes: fetchBytes,
		BatchTimeout: time.Millisecond, RequiredAcks: kafka.RequireAll, Transport: &kafka.Transport{}}
	t.Cleanup(func() { _ = w.Close() })
	return front{send: func(ctx context.Context, ids []string, value []byte) error {
		batch := make([]kafka.Message, len(ids))
		for i, id := range ids {
			batch[i] = kafkainbox.NewMessage(id, nil, value)
		}
		return w.WriteMessages(ctx, batch...)
	}}
}

// natsFront is natsinbox on a JetStream stream (file storage) of a NATS
// server in a child process, Concurrency 1: one lane.
func natsFront(t *testing.T) front {
	url := testsvc.StartNATSProcess(t).URL
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	subject := testsvc.Unique("overload")
	ctx := context.Background()
	for name, subj := range map[string]string{"S": subject, "DLQ": subject + natsinbox.DeadLetterSuffix} {
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subj}, Storage: jetstream.FileStorage})
		require.NoError(t, err)
	}
	// The consumer's connection is its own, as in a program.
	cc, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(cc.Close)
	return front{
		clientBuf: natsClientBuf,
		send: func(ctx context.Context, ids []string, value []byte) error {
			acks := make([]jetstream.PubAckFuture, len(ids))
			for i, id := range ids {
				m := nats.NewMsg(subject)
				m.Data = value
				m.Header.Set(jetstream.MsgIDHeader, id)
				if acks[i], err = js.PublishMsgAsync(m); err != nil {
					return err
				}
			}
			for _, a := range acks {
				select {
				case <-a.Ok():
				case err := <-a.Err():
					return err
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return nil
		},
		newConsumer: func(p consumer.Config, h consumer.Handler) (runner, error) {
			return natsinbox.New(natsinbox.Config{Conn: cc, Stream: "S", Durable: "overload", Processor: p,
				Scheduling: consumer.Scheduling{MaxBuffered: maxBuffered, BatchSize: batchSize}}, h)
		},
	}
}

// rig is a front's consumer at work: its handler is the bottleneck, its
// effects are counted in Postgres.
type rig struct {
	f        front
	pg       *testsvc.PG
	executed atomic.Int64
	produced int
	value    []byte
	ctx      context.Context
}

// newRig starts f's consumer and sees it run 10 events.
func newRig(t *testing.T, f front) *rig {
	r := &rig{f: f, value: make([]byte, msgSize)}
	r.pg = testsvc.Postgres(t, testsvc.MaxConns(4))
	r.pg.Exec(t, `CREATE TABLE effects (key text NOT NULL, n bigserial)`)
	l, err := inbox.New(r.pg.Pool, inbox.Config{})
	require.NoError(t, err)
	c, err := f.newConsumer(consumer.Config{Ledger: l, Hooks: consumer.Hooks{
		// Counted once committed.
		OnOutcome: func(_ *consumer.Message, out inbox.Outcome, _ time.Duration) {
			if out.Disposition == inbox.Executed {
				r.executed.Add(1)
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
	t.Cleanup(stop)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	r.ctx = ctx
	r.send(t, 10)
	testsvc.Eventually(t, time.Minute, func() bool { return r.executed.Load() == 10 }, "the consumer runs")
	return r
}

// send publishes n more events.
func (r *rig) send(t *testing.T, n int) {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("e-%d", r.produced+i)
	}
	require.NoError(t, r.f.send(r.ctx, ids, r.value))
	r.produced += n
}

// sample is the live heap and the backlog (produced, not committed) at a
// time of the run.
type sample struct {
	at            time.Duration
	heap, backlog int64
}

func (r *rig) sample(start time.Time) sample {
	return sample{time.Since(start), int64(liveHeap()), int64(r.produced) - r.executed.Load()}
}

// drain waits until every event has committed, and checks each had its
// effect once.
func (r *rig) drain(t *testing.T) {
	testsvc.Eventually(t, 2*time.Minute, func() bool { return r.executed.Load() >= int64(r.produced) }, "the backlog drains")
	require.Equal(t, r.produced, r.pg.Count(t, `SELECT count(*) FROM effects`), "effects (doubled if more, lost if fewer)")
	require.Equal(t, r.produced, r.pg.Count(t, `SELECT count(DISTINCT key) FROM effects`), "distinct effects")
}

// bound is what a front's consumer may hold: MaxBuffered messages waiting
// in its lane, a batch (BatchSize messages) taken from it and running, and
// its broker client's own buffer.
func (f front) bound() int64 { return (maxBuffered+batchSize)*msgSize + f.clientBuf }

// Offered twice what its handler can take, a Kafka consumer falls behind
// with its memory flat: fetching pauses while MaxBuffered messages wait,
// so the backlog stays in the broker. Its live heap, measured a third of
// the way into the load and at its end, grows by less than its buffers
// hold (see bound), while the backlog grows by hundreds;
// then it drains the backlog, every event once. Both Kafka fronts:
// kafkainbox (kafka-go) and franzinbox (franz-go).
func TestOverloadKafkaConsumerMemoryFlat(t *testing.T) {
	for _, fr := range fronts[:2] {
		t.Run(fr.name, func(t *testing.T) { consumerMemoryFlat(t, fr.make(t)) })
	}
}

// The same for natsinbox on JetStream, the NATS server in a process of its
// own: its pulls pause while MaxBuffered messages wait in its lane and as
// many in the client, the backlog stays in the stream.
func TestOverloadNATSConsumerMemoryFlat(t *testing.T) {
	consumerMemoryFlat(t, natsFront(t))
}

func consumerMemoryFlat(t *testing.T, f front) {
	r := newRig(t, f)
	// Twice what it takes: 2/perMessage a second, in batches every tick.
	perTick := int(2 * tick / perMessage)
	var samples []sample
	start := time.Now()
	tk := time.NewTicker(tick)
	for i := 0; time.Since(start) < produceFor; i++ {
		r.send(t, perTick)
		if i == int(produceFor/tick)/3 || time.Since(start)+tick >= produceFor {
			samples = append(samples, r.sample(start))
		}
		<-tk.C
	}
	tk.Stop()
	offered := float64(r.produced-10) / time.Since(start).Seconds()
	a, b := samples[0], samples[len(samples)-1]
	taken := float64(r.executed.Load()-10) / time.Since(start).Seconds()
	t.Logf("overload %s: offered %.0f events/s of %d KiB, taken %.0f/s; at %s live heap %.1f MiB, backlog %d; at %s live heap %.1f MiB, backlog %d; "+
		"growth %+.2f MiB, bound (MaxBuffered + BatchSize) x size + the client's buffer = %.2f MiB",
		t.Name(), offered, msgSize>>10, taken, a.at.Round(time.Millisecond), mib(a.heap), a.backlog, b.at.Round(time.Millisecond), mib(b.heap), b.backlog,
		mib(b.heap-a.heap), mib(f.bound()))
	require.Greater(t, offered, 1.5*taken, "the load was not twice what the consumer takes")
	require.Greater(t, b.backlog-a.backlog, int64(4*maxBuffered), "the backlog did not grow: the consumer kept up")
	require.Less(t, b.heap-a.heap, f.bound(), "the live heap grew with the backlog")
	r.drain(t)
}

// A consumer offered half what it takes, then a burst of ten times that
// (five times what it takes) for two seconds: during the burst its live
// heap stays within what its buffers hold (see bound) plus a slack of
// 0.75 MiB above the heap of the steady load, while the backlog grows in
// the broker; then it drains it, every event once. The three consumer
// fronts: kafkainbox, franzinbox, natsinbox (its NATS server in a process
// of its own). The ratio of the burst's highest heap to the steady one is
// logged.
func TestOverloadConsumerBurstMemoryFlat(t *testing.T) {
	for _, fr := range fronts {
		t.Run(fr.name, func(t *testing.T) { consumerBurst(t, fr.make(t)) })
	}
}

func consumerBurst(t *testing.T, f front) {
	const steadyFor, burstFor = 2 * time.Second, 2 * time.Second
	r := newRig(t, f)
	steadyPerTick := int(tick / perMessage / 2)
	start := time.Now()
	tk := time.NewTicker(tick)
	defer tk.Stop()
	var steady []sample
	for time.Since(start) < steadyFor {
		r.send(t, steadyPerTick)
		<-tk.C
		if time.Since(start) >= steadyFor/2 {
			steady = append(steady, r.sample(start))
		}
	}
	// The steady heap: the highest of the second half of the steady load.
	base := steady[0]
	for _, s := range steady {
		if s.heap > base.heap {
			base = s
		}
	}
	burstStart := time.Now()
	peak := sample{}
	var last sample
	for i := 0; time.Since(burstStart) < burstFor; i++ {
		r.send(t, 10*steadyPerTick)
		<-tk.C
		if i%2 == 1 {
			last = r.sample(start)
			if last.heap > peak.heap {
				peak = last
			}
		}
	}
	t.Logf("burst %s: %d events/s of %d KiB for %s, then %d/s for %s (about %.0f/s taken); live heap steady %.2f MiB (backlog %d), "+
		"burst peak %.2f MiB at %s (backlog %d; %d at the burst's end): burst/steady %.2f, growth %+.2f MiB, bound (MaxBuffered + BatchSize) x size + the client's buffer + slack = %.2f MiB",
		t.Name(), steadyPerTick*int(time.Second/tick), msgSize>>10, steadyFor, 10*steadyPerTick*int(time.Second/tick), burstFor, float64(time.Second/perMessage),
		mib(base.heap), base.backlog, mib(peak.heap), peak.at.Round(time.Millisecond), peak.backlog, last.backlog,
		float64(peak.heap)/float64(base.heap), mib(peak.heap-base.heap), mib(f.bound()+slack))
	require.Greater(t, last.backlog, int64(4*maxBuffered), "the burst did not outrun the consumer: no backlog in the broker")
	require.Less(t, peak.heap-base.heap, f.bound()+slack, "the live heap grew with the burst beyond the buffers")
	r.drain(t)
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }
