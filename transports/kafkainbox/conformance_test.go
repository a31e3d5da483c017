package kafkainbox_test

import (
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// harness adapts the Kafka consumer to the transport conformance suite.
type harness struct{ brokers []string }

func (h *harness) NewTopic(t *testing.T) string { return newTopic(t, h.brokers, 4) }

func (h *harness) Publish(t *testing.T, topic string, msgs []consumertest.Msg) {
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
	publish(t, h.brokers, topic, out...)
}

func (h *harness) Start(t *testing.T, topic, group string, opts consumertest.Options) func() {
	return start(t, kafkainbox.Config{
		Brokers:    h.brokers,
		Topic:      topic,
		GroupID:    group,
		Processor:  opts.Config,
		Scheduling: consumer.Scheduling{BatchSize: suiteBatch(opts.BatchSize)},
	}, opts.Handler)
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

func TestConformance(t *testing.T) {
	t.Parallel()
	consumertest.Run(t, &harness{brokers: testsvc.KafkaBrokers(t)}, consumertest.Features{Batch: true, SharedGroup: true})
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
