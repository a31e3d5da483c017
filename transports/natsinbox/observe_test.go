package natsinbox

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// TestObserveModeRunsDuplicates: a JetStream consumer in observe mode runs
// every copy of an event stored again after the stream's duplicate window
// (and one without Nats-Msg-Id), as the at-least-once consumer it
// replaces, while the ledger records the ID under the observe scope and
// the hook says which runs dedupe would have skipped.
func TestObserveModeRunsDuplicates(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("observe")
	const window = 200 * time.Millisecond
	stream := e.stream(t, subject, window)
	var mu sync.Mutex
	var would []string
	pc := fx.processor("billing")
	pc.Observe = true
	pc.Hooks.OnObserve = func(_ *consumer.Message, w string) {
		mu.Lock()
		defer mu.Unlock()
		would = append(would, w)
	}
	c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "billing", Processor: pc}, fx.insert)
	require.NoError(t, err)
	run(t, c)

	const id = "order-1"
	e.publish(t, subject, id, []byte("v1"))
	testsvc.Eventually(t, 10*time.Second, func() bool { return fx.effects(t, id) == 1 }, "first copy ran")
	testsvc.Eventually(t, 5*time.Second, func() bool { return !e.publish(t, subject, id, []byte("v2")).Duplicate },
		"republish after the %s duplicate window is stored", window)
	require.False(t, e.publish(t, subject, "", []byte("v3"), "ce-id", id).Duplicate)

	testsvc.Eventually(t, 10*time.Second, func() bool { return fx.effects(t, id) == 3 }, "every copy ran")
	testsvc.Eventually(t, 10*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "billing")
		return ci.NumAckPending == 0 && ci.NumPending == 0
	}, "every copy acked")
	require.EqualValues(t, 3, fx.runs.Load())
	mu.Lock()
	require.Equal(t, []string{consumer.WouldRun, consumer.WouldSkip, consumer.WouldSkip}, would)
	mu.Unlock()
	rec, err := fx.ledger.Lookup(t.Context(), inbox.Key{Scope: "billing" + consumer.ObserveSuffix, ID: id})
	require.NoError(t, err)
	require.Equal(t, Source, rec.Source)
	_, err = fx.ledger.Lookup(t.Context(), inbox.Key{Scope: "billing", ID: id})
	require.ErrorIs(t, err, inbox.ErrNotFound, "nothing recorded under the enforcing scope")
}
