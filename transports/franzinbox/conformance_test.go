package franzinbox_test

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/franzinbox"
)

// harness adapts the franz-go consumer to the transport conformance suite.
// perEvent runs the suite's unbatched tests with BatchSize 1 (one message,
// one transaction) instead of the default batches.
type harness struct {
	brokers  []string
	perEvent bool
}

func (h *harness) NewTopic(t *testing.T) string { return newTopic(t, h.brokers, 4) }

func (h *harness) Publish(t *testing.T, topic string, msgs []consumertest.Msg) {
	out := make([]*kgo.Record, len(msgs))
	for i, m := range msgs {
		var key []byte
		if m.Key != "" {
			key = []byte(m.Key)
		}
		if m.ID != "" {
			out[i] = franzinbox.NewRecord(m.ID, key, m.Value)
		} else {
			out[i] = &kgo.Record{Key: key, Value: m.Value}
		}
	}
	publish(t, h.brokers, topic, out...)
}

func (h *harness) Start(t *testing.T, topic, group string, opts consumertest.Options) func() {
	if h.perEvent && opts.BatchSize == 0 {
		opts.BatchSize = 1
	}
	return start(t, franzinbox.Config{
		Brokers:    h.brokers,
		Topics:     []string{topic},
		GroupID:    group,
		Processor:  opts.Config,
		Scheduling: consumer.Scheduling{BatchSize: opts.BatchSize},
	}, opts.Handler)
}

func (h *harness) DeadLetters(t *testing.T, topic string) []consumertest.DeadLetter {
	var out []consumertest.DeadLetter
	for _, r := range readAll(t, h.brokers, topic+franzinbox.DeadLetterSuffix) {
		dl := consumertest.DeadLetter{Value: r.Value, Headers: map[string]string{}}
		for _, hd := range r.Headers {
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

func TestConformancePerEvent(t *testing.T) {
	t.Parallel()
	consumertest.Run(t, &harness{brokers: testsvc.KafkaBrokers(t), perEvent: true}, consumertest.Features{})
}
