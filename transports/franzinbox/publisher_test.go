package franzinbox_test

import (
	"context"
	"crypto/rand"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/outboxtest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

// franzGo is the franz-go outbox publisher under the relay's end-to-end
// tests (harness/outboxtest), against the test Kafka broker.
var franzGo = outboxtest.Target{
	Name:   "franz-go",
	Broker: outbox.Kafka,
	Addr:   func(t testing.TB) string { return strings.Join(testsvc.KafkaBrokers(t), ",") },
	Publisher: func(addr string) (outbox.Publisher, func(), error) {
		// Batches the broker, not franz-go, refuses as too large.
		cl, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(addr, ",")...), kgo.ProducerBatchMaxBytes(4<<20))
		if err != nil {
			return nil, nil, err
		}
		p, err := franzinbox.NewOutboxPublisher(cl)
		if err != nil {
			cl.Close()
			return nil, nil, err
		}
		return p, func() { _ = p.Close(); cl.Close() }, nil
	},
	Server: func(addr string) string { return strings.Split(addr, ",")[0] },
	At:     func(hostPort string) string { return hostPort },
	Destination: func(t testing.TB, addr string, partitions int) string {
		return newTopic(t, strings.Split(addr, ","), int32(partitions))
	},
	Topic: func(dest, _ string) string { return dest },
	Read: func(t testing.TB, addr, dest string) []outboxtest.Received {
		var out []outboxtest.Received
		for _, rec := range readAll(t, strings.Split(addr, ","), dest) {
			r := outboxtest.Received{Order: string(rec.Key), Value: rec.Value}
			for _, h := range rec.Headers {
				r.Headers = append(r.Headers, consumer.Header{Key: h.Key, Value: h.Value})
			}
			r.ID = r.Header(outbox.KafkaIDHeader)
			out = append(out, r)
		}
		return out
	},
	Produce: func(t testing.TB, addr, dest string, events []outboxtest.Event) {
		recs := make([]*kgo.Record, len(events))
		for i, e := range events {
			recs[i] = franzinbox.NewRecord(e.ID, []byte(e.Key), e.Value)
		}
		publish(t, strings.Split(addr, ","), dest, recs...)
	},
	Consumer: func(t testing.TB, addr, dest, group string, pc consumer.Config, h consumer.Handler) interface {
		Run(context.Context) error
	} {
		c, err := franzinbox.New(franzinbox.Config{Brokers: strings.Split(addr, ","), Topics: []string{dest}, GroupID: group,
			Processor: pc, ClientOptions: fastGroup}, h)
		require.NoError(t, err)
		return c
	},
	Refused: func(t testing.TB, addr, dest string) []outboxtest.Refusal {
		return []outboxtest.Refusal{
			// The relay never has the broker create a topic.
			{Message: outbox.Message{Broker: outbox.Kafka, Topic: testsvc.Unique("missing"), Key: []byte("k"), Value: []byte("lost topic")},
				Want: "unknown_topic_or_partition"},
			// Over the broker's message.max.bytes (1 MiB), compressed too
			// (franz-go compresses batches with snappy by default).
			{Message: outbox.Message{Broker: outbox.Kafka, Topic: dest, Key: []byte("k"), Value: incompressible(2 << 20)},
				Want: "message_too_large"},
		}
	},
}

// incompressible returns n random bytes.
func incompressible(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func TestOutboxPublisherRefusals(t *testing.T)   { outboxtest.Refusals(t, franzGo) }
func TestOutboxPublisherBrokerAway(t *testing.T) { outboxtest.BrokerAway(t, franzGo) }
func TestOutboxPublisherTwoHop(t *testing.T)     { outboxtest.TwoHop(t, franzGo) }

// A franz-go user relays with franz-go alone: franzinbox, its outbox
// publisher included, links no other broker client.
func TestOutboxPublisherLinksOnlyFranzGo(t *testing.T) {
	outboxtest.LinksNone(t, "github.com/segmentio/", "github.com/nats-io/")
}

// NewOutboxPublisher refuses a client whose records the relay could not
// count as published for good, or that would not send them as handed.
func TestOutboxPublisherConfig(t *testing.T) {
	t.Parallel()
	seed := kgo.SeedBrokers("127.0.0.1:9")
	for name, opts := range map[string][]kgo.Opt{
		"leader acks":   {kgo.RequiredAcks(kgo.LeaderAck()), kgo.DisableIdempotentWrite()},
		"no acks":       {kgo.RequiredAcks(kgo.NoAck()), kgo.DisableIdempotentWrite()},
		"transactional": {kgo.TransactionalID("tx")},
		"one topic":     {kgo.DefaultProduceTopic("t"), kgo.DefaultProduceTopicAlways()},
		"manual flush":  {kgo.ManualFlushing()},
	} {
		cl, err := kgo.NewClient(append(opts, seed)...)
		require.NoError(t, err, name)
		_, err = franzinbox.NewOutboxPublisher(cl)
		require.ErrorIs(t, err, inbox.ErrConfig, name)
		cl.Close()
	}
	_, err := franzinbox.NewOutboxPublisher(nil)
	require.ErrorIs(t, err, inbox.ErrConfig)

	for name, opts := range map[string][]kgo.Opt{
		"defaults":        nil,
		"not idempotent":  {kgo.DisableIdempotentWrite()},
		"a default topic": {kgo.DefaultProduceTopic("t")},
	} {
		cl, err := kgo.NewClient(append(opts, seed)...)
		require.NoError(t, err, name)
		p, err := franzinbox.NewOutboxPublisher(cl)
		require.NoError(t, err, name)
		require.NoError(t, p.Close())
		cl.Close()
	}
}
