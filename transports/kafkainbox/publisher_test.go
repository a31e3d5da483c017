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
	"github.com/justonce/justonce/harness/outboxtest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// kafkaGo is the kafka-go outbox publisher under the relay's end-to-end
// tests (harness/outboxtest), against the test Kafka broker.
var kafkaGo = outboxtest.Target{
	Name:   "kafka-go",
	Broker: outbox.Kafka,
	Addr:   func(t testing.TB) string { return strings.Join(testsvc.KafkaBrokers(t), ",") },
	Publisher: func(addr string) (outbox.Publisher, func(), error) {
		// A transport of its own (the default one's metadata is shared and
		// cached), and batches the broker, not kafka-go, refuses as too
		// large.
		w := &kafka.Writer{Addr: kafka.TCP(strings.Split(addr, ",")...), Transport: &kafka.Transport{}, BatchBytes: 4 << 20}
		p, err := kafkainbox.NewOutboxPublisher(w)
		if err != nil {
			_ = w.Close()
			return nil, nil, err
		}
		return p, func() { _ = p.Close(); _ = w.Close() }, nil
	},
	Server: func(addr string) string { return strings.Split(addr, ",")[0] },
	At:     func(hostPort string) string { return hostPort },
	Destination: func(t testing.TB, addr string, partitions int) string {
		return newTopic(t, strings.Split(addr, ","), partitions)
	},
	Topic: func(dest, _ string) string { return dest },
	Read: func(t testing.TB, addr, dest string) []outboxtest.Received {
		var out []outboxtest.Received
		for _, m := range readAll(t, strings.Split(addr, ","), dest) {
			r := outboxtest.Received{Order: string(m.Key), Value: m.Value}
			for _, h := range m.Headers {
				r.Headers = append(r.Headers, consumer.Header{Key: h.Key, Value: h.Value})
			}
			r.ID = r.Header(outbox.KafkaIDHeader)
			out = append(out, r)
		}
		return out
	},
	Produce: func(t testing.TB, addr, dest string, events []outboxtest.Event) {
		msgs := make([]kafka.Message, len(events))
		for i, e := range events {
			msgs[i] = kafkainbox.NewMessage(e.ID, []byte(e.Key), e.Value)
		}
		publish(t, strings.Split(addr, ","), dest, msgs...)
	},
	Consumer: func(t testing.TB, addr, dest, group string, pc consumer.Config, h consumer.Handler) interface {
		Run(context.Context) error
	} {
		c, err := kafkainbox.New(kafkainbox.Config{Brokers: strings.Split(addr, ","), Topic: dest, GroupID: group,
			Processor: pc, Reader: tuneReader}, h)
		require.NoError(t, err)
		return c
	},
	Refused: func(t testing.TB, addr, dest string) []outboxtest.Refusal {
		return []outboxtest.Refusal{
			// The relay never has the broker create a topic.
			{Message: outbox.Message{Broker: outbox.Kafka, Topic: testsvc.Unique("missing"), Key: []byte("k"), Value: []byte("lost topic")},
				Want: "unknown topic"},
			// Over the broker's message.max.bytes (1 MiB).
			{Message: outbox.Message{Broker: outbox.Kafka, Topic: dest, Key: []byte("k"), Value: make([]byte, 2<<20)},
				Want: "too large"},
		}
	},
}

func TestOutboxPublisherRefusals(t *testing.T)   { outboxtest.Refusals(t, kafkaGo) }
func TestOutboxPublisherBrokerAway(t *testing.T) { outboxtest.BrokerAway(t, kafkaGo) }
func TestOutboxPublisherTwoHop(t *testing.T)     { outboxtest.TwoHop(t, kafkaGo) }

// kafkainbox links kafka-go alone of the broker clients: its outbox
// publisher brings no other.
func TestOutboxPublisherLinksOnlyKafkaGo(t *testing.T) {
	outboxtest.LinksNone(t, "github.com/twmb/franz-go", "github.com/nats-io/")
}

// NewOutboxPublisher refuses a writer the relay cannot use, sets acks
// from every in-sync replica, and fills the writer's unset batching and
// balancer as its doc says, leaving set ones alone.
func TestOutboxPublisherConfig(t *testing.T) {
	t.Parallel()
	for name, w := range map[string]*kafka.Writer{
		"nil":   nil,
		"async": {Addr: kafka.TCP("127.0.0.1:9"), Async: true},
		"topic": {Addr: kafka.TCP("127.0.0.1:9"), Topic: "t"},
	} {
		_, err := kafkainbox.NewOutboxPublisher(w)
		require.ErrorIs(t, err, inbox.ErrConfig, name)
	}

	w := &kafka.Writer{Addr: kafka.TCP("127.0.0.1:9"), RequiredAcks: kafka.RequireOne}
	_, err := kafkainbox.NewOutboxPublisher(w)
	require.NoError(t, err)
	require.Equal(t, kafka.RequireAll, w.RequiredAcks)
	balancesLike(t, kafka.Murmur2Balancer{}, w.Balancer)
	require.Equal(t, outbox.DefaultBatchSize, w.BatchSize)
	require.Equal(t, time.Millisecond, w.BatchTimeout)

	set := &kafka.Writer{Addr: kafka.TCP("127.0.0.1:9"), Balancer: &kafka.Hash{}, BatchSize: 7, BatchTimeout: time.Second}
	_, err = kafkainbox.NewOutboxPublisher(set)
	require.NoError(t, err)
	balancesLike(t, &kafka.Hash{}, set.Balancer)
	require.Equal(t, 7, set.BatchSize)
	require.Equal(t, time.Second, set.BatchTimeout)
}

// balancesLike checks that got (the publisher's wrapper of the writer's
// Balancer) sends messages that name no partition where want does.
func balancesLike(t *testing.T, want, got kafka.Balancer) {
	t.Helper()
	parts := []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
	for i := range 200 {
		m := kafka.Message{Key: []byte("key-" + strconv.Itoa(i))}
		require.Equal(t, want.Balance(m, parts...), got.Balance(m, parts...), "key-%d", i)
	}
}
