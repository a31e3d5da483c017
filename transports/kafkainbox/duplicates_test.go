package kafkainbox_test

import (
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// 10,000 events, 20 % of them produced again with the same ID at later
// offsets: each runs once, and the duplicates are acked (their offsets
// committed) without running the handler.
func TestTenThousandWithDuplicates(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 4)
	const unique, dups = 10_000, 2_000

	msgs := events("e", 0, unique, 64)
	again := make([]kafka.Message, 0, dups)
	for i := 0; i < dups; i++ {
		again = append(again, msgs[i*unique/dups]) // same ID, same key: same partition, later offset
	}
	publish(t, brokers, topic, msgs...)
	publish(t, brokers, topic, again...)

	group := "g-" + topic
	stop := start(t, kafkainbox.Config{
		Brokers:    brokers,
		Topic:      topic,
		GroupID:    group,
		Processor:  fx.processor(),
		Scheduling: consumer.Scheduling{Concurrency: 4, Ordering: consumer.ByKey},
	}, fx.insert)
	testsvc.Eventually(t, 120*time.Second, func() bool { return fx.executed.Load()+fx.dups.Load() >= unique+dups },
		"all %d deliveries answered (executed %d, duplicates %d)", unique+dups, fx.executed.Load(), fx.dups.Load())
	stop()

	fx.assertExactlyOnce(t, unique)
	require.EqualValues(t, unique, fx.runs.Load(), "handler runs: duplicates must not run it")
	require.EqualValues(t, unique, fx.executed.Load(), "executed")
	require.EqualValues(t, dups, fx.dups.Load(), "duplicates answered by the ledger")
	requireNoLag(t, brokers, group, topic)
}
