package natsinbox

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
)

// harness adapts JetStream to the transport conformance suite.
type harness struct {
	env *env
}

// dupWindow is the test streams' duplicate window: short, so that the
// suite's republished IDs reach the consumer (see Publish).
const dupWindow = 100 * time.Millisecond

func (h *harness) NewTopic(t *testing.T) string {
	subject := testsvc.Unique("ev")
	h.env.stream(t, subject, dupWindow)
	return subject
}

// Publish publishes each message with its ID in Nats-Msg-Id. JetStream
// drops a republished ID inside the stream's duplicate window; the suite
// wants every message to arrive, so a message JetStream reports as a
// duplicate is published again until the window has passed and it is
// stored (the PubAck says so: no sleep-and-hope).
func (h *harness) Publish(t *testing.T, topic string, msgs []consumertest.Msg) {
	for _, m := range msgs {
		deadline := time.Now().Add(10 * time.Second)
		for h.env.publish(t, topic, m.ID, m.Value).Duplicate {
			require.True(t, time.Now().Before(deadline), "publish of %q still a duplicate after 10s", m.ID)
			time.Sleep(dupWindow / 5)
		}
	}
}

// config is the Consumer's Config on nc. Its AckWait, how long the server
// waits before it redelivers a message a killed consumer took, is 5 s
// rather than the server's 30 s, as a program may set it: the tests do not
// wait out 30 s after each kill.
func (h *harness) config(nc *nats.Conn, topic, group string, opts consumertest.Options) Config {
	return Config{
		Conn:       nc,
		Stream:     "S-" + topic,
		Durable:    group,
		Processor:  opts.Config,
		Scheduling: consumer.Scheduling{Concurrency: opts.Concurrency, BatchSize: suiteBatch(opts.BatchSize)},
		AckWait:    5 * time.Second,
	}
}

func (h *harness) Start(t *testing.T, topic, group string, opts consumertest.Options) (stop func()) {
	nc, err := nats.Connect(h.env.url)
	require.NoError(t, err)
	c, err := New(h.config(nc, topic, group, opts), opts.Handler)
	require.NoError(t, err)
	stopRun, _ := consumertest.Start(t, c)
	return func() {
		stopRun()
		nc.Close()
	}
}

func (h *harness) DeadLetters(t *testing.T, topic string) []consumertest.DeadLetter {
	var out []consumertest.DeadLetter
	for _, m := range h.env.deadLetters(t, topic) {
		dl := consumertest.DeadLetter{Value: m.Data, Headers: map[string]string{}}
		for k, vs := range m.Header {
			if len(vs) > 0 {
				dl.Headers[k] = vs[0]
			}
		}
		dl.ID = dl.Headers[consumer.HeaderDLID]
		out = append(out, dl)
	}
	return out
}

// Pending: the durable's messages not delivered yet, and those delivered
// and not acked.
func (h *harness) Pending(t *testing.T, topic, group string) int {
	ci := h.env.consumerInfo(t, "S-"+topic, group)
	return int(ci.NumPending) + ci.NumAckPending
}

func (h *harness) PostgresURL(t *testing.T) string { return testsvc.PostgresURL(t) }

// ChildEnv gives the child process the server, embedded in this process.
func (h *harness) ChildEnv() []string { return []string{testsvc.EnvNATS + "=" + h.env.url} }

func (h *harness) RunChild(ctx context.Context, topic, group string, opts consumertest.Options) error {
	nc, err := nats.Connect(h.env.url)
	if err != nil {
		return err
	}
	defer nc.Close()
	c, err := New(h.config(nc, topic, group, opts), opts.Handler)
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

func (h *harness) Replay(t *testing.T, topic, group string, opts consumertest.Options, since time.Time, ro consumer.ReplayOptions) (consumer.ReplayReport, error) {
	c, err := New(h.config(h.env.nc, topic, group, opts), opts.Handler)
	require.NoError(t, err)
	return c.Replay(context.Background(), ReplayConfig{StartTime: since, FetchWait: 500 * time.Millisecond}, ro)
}

// No Stall case: a JetStream consumer has no lanes to hold up apart (its
// messages share one lane, in no order across Concurrency).
func TestConformance(t *testing.T) {
	t.Parallel()
	consumertest.Run(t, &harness{env: newEnv(t)}, consumertest.Features{Batch: true, SharedGroup: true, Crash: true, Replay: true})
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
