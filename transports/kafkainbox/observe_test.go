package kafkainbox_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// TestObserveModeRunsDuplicates: a kafka-go consumer in observe mode runs
// every message, duplicates too, as the at-least-once consumer it
// replaces, while the ledger records the IDs under the group's observe
// scope and the hook says which runs dedupe would have skipped.
func TestObserveModeRunsDuplicates(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 2)
	group := "g-" + topic

	// 20 IDs, each sent twice, and 5 of them a third time.
	msgs := append(events("e", 0, 20, 4), events("e", 0, 20, 4)...)
	msgs = append(msgs, events("e", 0, 5, 4)...)
	publish(t, brokers, topic, msgs...)

	var mu sync.Mutex
	would := map[string]int{}
	pc := fx.processor()
	pc.Observe = true
	pc.Hooks.OnObserve = func(_ *consumer.Message, w string) {
		mu.Lock()
		defer mu.Unlock()
		would[w]++
	}
	stop := start(t, kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: pc}, fx.insert)
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) >= len(msgs) }, "every message ran")
	stop()
	requireNoLag(t, brokers, group, topic)

	require.Equal(t, len(msgs), fx.effects(t), "duplicates ran: at least once, as before")
	require.Equal(t, 20, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, map[string]int{consumer.WouldRun: 20, consumer.WouldSkip: 25}, would)
	require.Equal(t, 20, fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = $1`, group+consumer.ObserveSuffix))
	require.Equal(t, 0, fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = $1`, group))
}
