package kafkainbox_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// A member that has finished messages of a partition but not yet committed
// them when the partition moves must not commit them later, over what the
// new owner committed since: the group's offset would go back and the new
// owner (or a restart) would read those messages again. A runs every event
// of a two-partition topic and commits only when it must (an hour's
// interval); B joins, takes one partition and runs new events on it to
// its end, and commits. When A then stops, B's partition's committed
// offset is still its end.
func TestLateCommitNeverMovesTheOffsetBack(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 2)
	group := "g-" + topic
	const n = 200

	cfgA := kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor(),
		CommitInterval: time.Hour}
	t.Cleanup(func() {
		if t.Failed() {
			logGroup(t, brokers, group)
		}
	})
	publish(t, brokers, topic, events("lc", 0, n, 50)...)
	stopA := start(t, cfgA, fx.insert)
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) == n }, "A ran the first events")
	for p, l := range lag(t, brokers, group, topic) {
		require.NotZero(t, l, "A has committed nothing of partition %d yet", p)
	}

	var bPart atomic.Int64
	bPart.Store(-1)
	var bExecuted atomic.Int64
	cfgB := cfgA
	cfgB.CommitInterval = 100 * time.Millisecond
	cfgB.Processor = fx.processor()
	cfgB.Processor.Hooks.OnOutcome = func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
		if out.Disposition == inbox.Executed {
			bExecuted.Add(1)
			bPart.Store(int64(m.Partition))
		}
	}
	stopB := start(t, cfgB, fx.insert)
	// New events: those of B's partition run on B once the group has
	// rebalanced.
	testsvc.Eventually(t, 90*time.Second, func() bool {
		publish(t, brokers, topic, events("lc2-"+time.Now().Format("150405.000"), 0, 20, 20)...)
		return bExecuted.Load() > 0
	}, "B runs events of its partition")
	p := int(bPart.Load())
	waitFor := func(what string) {
		testsvc.Eventually(t, 60*time.Second, func() bool { return lag(t, brokers, group, topic)[p] == 0 }, "%s", what)
	}
	waitFor("B committed its partition to its end")

	stopA()
	require.Zero(t, lag(t, brokers, group, topic)[p],
		"A's commit on leaving moved partition %d's offset back below what B committed", p)
	stopB()
	fx.assertExactlyOnce(t, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
}
