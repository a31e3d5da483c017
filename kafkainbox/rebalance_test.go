package kafkainbox_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/kafkainbox"
)

// Two consumers in one group: B joins mid-stream while one of A's handlers
// is held in flight (its effect written, its transaction open), so the
// rebalance happens with work in flight; then A leaves mid-stream (another
// rebalance). Nothing is lost, nothing runs twice, and every offset ends up
// committed.
func TestRebalanceLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 6)
	group := "g-" + topic
	const n = 3000

	var runsA, runsB atomic.Int64
	var (
		once     sync.Once
		held     = make(chan string, 1) // the ID A holds in flight
		release  = make(chan struct{})
		returned atomic.Bool // A's held handler has returned
	)
	handler := func(runs *atomic.Int64, hold bool) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			r := runs.Add(1)
			time.Sleep(500 * time.Microsecond) // keep work in flight across the rebalances
			if err := fx.insert(ctx, tx, m); err != nil {
				return err
			}
			if hold && r == n/10 {
				once.Do(func() {
					held <- m.ID
					<-release
					returned.Store(true)
				})
			}
			return nil
		}
	}
	cfg := kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor()}

	t.Cleanup(func() { // what to look at when it fails
		if t.Failed() {
			t.Logf("handler runs: A %d, B %d; effects %d", runsA.Load(), runsB.Load(), fx.effects(t))
			logGroup(t, brokers, group)
		}
	})
	publish(t, brokers, topic, events("r", 0, n/2, 50)...)
	stopA := start(t, cfg, handler(&runsA, true))
	releaseHeld := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseHeld) // before stopA's cleanup, should the test fail early
	var heldID string
	select {
	case heldID = <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("A did not reach the handler it holds")
	}

	cfgB := cfg
	cfgB.Concurrency = 3
	stopB := start(t, cfgB, handler(&runsB, false))
	publish(t, brokers, topic, events("r", n/2, n, 50)...)
	publish(t, brokers, topic, events("r", 0, n/5, 50)...) // redeliveries of early IDs
	// B needs only to run some handlers: A keeps its other partitions busy
	// until the rebalance, and may have consumed most of the stream by then
	// (a CI run saw A run 2,474 handlers and B 160 at this point).
	testsvc.Eventually(t, 60*time.Second, func() bool { return runsB.Load() >= n/100 }, "B gets partitions and progresses")
	require.False(t, returned.Load(), "A's handler was still in flight when the group rebalanced for B")
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = $1`, heldID), "the held effect is not committed yet")
	releaseHeld()
	require.Less(t, fx.effects(t), n, "the stream should still be running when A leaves")
	stopA()
	testsvc.Eventually(t, 90*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n
	}, "all processed by the group")
	waitNoLag(t, brokers, group, topic) // the trailing duplicates are acked too
	stopB()

	fx.assertExactlyOnce(t, n)
	require.EqualValues(t, n, runsA.Load()+runsB.Load(), "handler runs (A %d, B %d)", runsA.Load(), runsB.Load())
	requireNoLag(t, brokers, group, topic)
	t.Logf("A ran %d, B ran %d, duplicates answered %d; A held %s in flight across the rebalance", runsA.Load(), runsB.Load(), fx.dups.Load(), heldID)
}
