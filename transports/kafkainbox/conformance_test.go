package kafkainbox_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// harness adapts the Kafka consumer to the transport conformance suite.
type harness struct{ brokers []string }

func (h *harness) NewTopic(t *testing.T) string { return newTopic(t, h.brokers, 4) }

func (h *harness) Publish(t *testing.T, topic string, msgs []consumertest.Msg) {
	publish(t, h.brokers, topic, messages(msgs)...)
}

// PublishLane writes to partition lane.
func (h *harness) PublishLane(t *testing.T, topic string, lane int, msgs []consumertest.Msg) {
	publishTo(t, h.brokers, topic, lane, messages(msgs)...)
}

func messages(msgs []consumertest.Msg) []kafka.Message {
	out := make([]kafka.Message, len(msgs))
	for i, m := range msgs {
		var key []byte
		if m.Key != "" {
			key = []byte(m.Key)
		}
		if m.ID != "" {
			out[i] = kafkainbox.NewMessage(m.ID, key, m.Value)
		} else {
			out[i] = kafka.Message{Key: key, Value: m.Value}
		}
	}
	return out
}

// config is a Consumer's Config with the package's defaults; start tunes
// its group timings for tests, RunChild does not.
func (h *harness) config(topic, group string, opts consumertest.Options) kafkainbox.Config {
	return kafkainbox.Config{
		Brokers:    h.brokers,
		Topic:      topic,
		GroupID:    group,
		Processor:  opts.Config,
		Scheduling: consumer.Scheduling{Concurrency: opts.Concurrency, BatchSize: suiteBatch(opts.BatchSize)},
	}
}

func (h *harness) Start(t *testing.T, topic, group string, opts consumertest.Options) func() {
	return start(t, h.config(topic, group, opts), opts.Handler)
}

func (h *harness) DeadLetters(t *testing.T, topic string) []consumertest.DeadLetter {
	var out []consumertest.DeadLetter
	for _, m := range readAll(t, h.brokers, topic+kafkainbox.DeadLetterSuffix) {
		dl := consumertest.DeadLetter{Value: m.Value, Headers: map[string]string{}}
		for _, hd := range m.Headers {
			dl.Headers[hd.Key] = string(hd.Value)
		}
		dl.ID = dl.Headers[consumer.HeaderDLID]
		out = append(out, dl)
	}
	return out
}

func (h *harness) Pending(t *testing.T, topic, group string) int {
	n := int64(0)
	for _, l := range lag(t, h.brokers, group, topic) {
		n += l
	}
	return int(n)
}

func (h *harness) PostgresURL(t *testing.T) string { return testsvc.PostgresURL(t) }

// ChildEnv gives the child process the brokers (the parent may have
// started them in a container).
func (h *harness) ChildEnv() []string {
	return []string{testsvc.EnvKafka + "=" + strings.Join(h.brokers, ",")}
}

// RunChild runs a Consumer with the package's default group timings.
func (h *harness) RunChild(ctx context.Context, topic, group string, opts consumertest.Options) error {
	c, err := kafkainbox.New(h.config(topic, group, opts), opts.Handler)
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

func (h *harness) Replay(t *testing.T, topic, group string, opts consumertest.Options, since time.Time, ro consumer.ReplayOptions) (consumer.ReplayReport, error) {
	c, err := kafkainbox.New(h.config(topic, group, opts), opts.Handler)
	require.NoError(t, err)
	return c.Replay(context.Background(), kafkainbox.ReplayConfig{StartTime: since}, ro)
}

// restartBound is how soon a consumer restarted after a SIGKILL must have
// its first effect: the default session timeout (10 s) plus a rebalance;
// with kafka-go's own default it would be over 30 s.
const restartBound = 15 * time.Second

func TestConformance(t *testing.T) {
	t.Parallel()
	consumertest.Run(t, &harness{brokers: testsvc.KafkaBrokers(t)}, consumertest.Features{
		Batch: true, SharedGroup: true, Crash: true, CrashRestart: restartBound, Stall: true, Replay: true,
	})
}

// suiteBatch maps the suite's batch size to the Config's: the suite's
// per-message runs (0) turn batching off, so that the suite covers both
// modes (its batch runs set a size).
func suiteBatch(n int) int {
	if n == 0 {
		return 1
	}
	return n
}

// A replay reports each partition it read, with its first and last
// offsets; with ReplayConfig.Partitions and StartOffset it reads those
// partitions only, from that offset: what this front's replay adds to the
// suite's Replay case.
func TestReplayPartitionsFromAnOffset(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 3)
	const per = 10
	for p := range 3 {
		publishTo(t, brokers, topic, p, events("p"+strconv.Itoa(p), 0, per, 1)...)
	}
	c, err := kafkainbox.New(kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: "g-" + topic, Processor: fx.processor()}, fx.insert)
	require.NoError(t, err)
	ctx := context.Background()

	rep, err := c.Replay(ctx, kafkainbox.ReplayConfig{}, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Len(t, rep.Partitions, 3)
	for i, p := range rep.Partitions {
		require.Equal(t, consumer.PartitionReport{Partition: i, Seen: per, Ran: per, First: 0, Last: per - 1}, p)
	}

	rep, err = c.Replay(ctx, kafkainbox.ReplayConfig{Partitions: []int{2, 0}, StartOffset: 4}, consumer.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, rep.Partitions, 2)
	for i, p := range rep.Partitions {
		require.Equal(t, consumer.PartitionReport{Partition: 2 * i, Seen: per - 4, Ran: per - 4, First: 4, Last: per - 1}, p)
	}
	fx.assertExactlyOnce(t, 2*(per-4))
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE part = 1 OR off < 4`))
}
