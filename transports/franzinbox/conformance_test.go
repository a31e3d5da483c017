package franzinbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/franzinbox"
)

// harness adapts the franz-go consumer to the transport conformance suite.
// perEvent runs the suite's unbatched cases with BatchSize 1 (one message,
// one transaction) instead of the default batches.
type harness struct {
	brokers  []string
	perEvent bool
}

func (h *harness) NewTopic(t *testing.T) string { return newTopic(t, h.brokers, 4) }

func (h *harness) Publish(t *testing.T, topic string, msgs []consumertest.Msg) {
	publish(t, h.brokers, topic, records(msgs)...)
}

// PublishLane writes to partition lane.
func (h *harness) PublishLane(t *testing.T, topic string, lane int, msgs []consumertest.Msg) {
	publishTo(t, h.brokers, topic, int32(lane), records(msgs)...)
}

func records(msgs []consumertest.Msg) []*kgo.Record {
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
	return out
}

// config is a Consumer's Config with the package's defaults; start tunes
// its group timings for tests, RunChild does not.
func (h *harness) config(topic, group string, opts consumertest.Options) franzinbox.Config {
	if h.perEvent && opts.BatchSize == 0 {
		opts.BatchSize = 1
	}
	return franzinbox.Config{
		Brokers:    h.brokers,
		Topics:     []string{topic},
		GroupID:    group,
		Processor:  opts.Config,
		Scheduling: consumer.Scheduling{Concurrency: opts.Concurrency, BatchSize: opts.BatchSize},
	}
}

func (h *harness) Start(t *testing.T, topic, group string, opts consumertest.Options) func() {
	return start(t, h.config(topic, group, opts), opts.Handler)
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
	c, err := franzinbox.New(h.config(topic, group, opts), opts.Handler)
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

func (h *harness) Replay(t *testing.T, topic, group string, opts consumertest.Options, since time.Time, ro consumer.ReplayOptions) (consumer.ReplayReport, error) {
	c, err := franzinbox.New(h.config(topic, group, opts), opts.Handler)
	require.NoError(t, err)
	return c.Replay(context.Background(), franzinbox.ReplayConfig{StartTime: since}, ro)
}

// restartBound is how soon a consumer restarted after a SIGKILL must have
// its first effect: the default session timeout (10 s) plus a rebalance;
// with franz-go's own default it would be over 45 s.
const restartBound = 15 * time.Second

// With the default batches; the crash cases with them and, in BatchCrash,
// smaller ones.
func TestConformance(t *testing.T) {
	t.Parallel()
	consumertest.Run(t, &harness{brokers: testsvc.KafkaBrokers(t)}, consumertest.Features{
		Batch: true, SharedGroup: true, Crash: true, CrashRestart: restartBound, Stall: true, Replay: true,
	})
}

// One message a transaction; the crash case too.
func TestConformancePerEvent(t *testing.T) {
	t.Parallel()
	consumertest.Run(t, &harness{brokers: testsvc.KafkaBrokers(t), perEvent: true}, consumertest.Features{
		Crash: true, CrashRestart: restartBound,
	})
}
