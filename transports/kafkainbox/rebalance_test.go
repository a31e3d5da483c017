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
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
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

// A shutdown waits up to ShutdownTimeout for the handlers in flight, but a
// rebalance that ends the generation during that wait cuts it to the
// rebalance's (half the lesser of the rebalance and session timeouts): the
// member's heartbeats have stopped, and waiting out a long ShutdownTimeout
// would get it dropped from the group. A, stopping with a ShutdownTimeout of
// five minutes, holds a handler that returns only once it is cancelled; B
// joins the group. A's Run returns well within the five minutes, its
// handler was cancelled in flight, and B runs the message once.
func TestRebalanceCutsShutdownWait(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 2)
	group := "g-" + topic
	const shutdown = 5 * time.Minute

	started := make(chan string, 1)
	var cancelled atomic.Bool
	holdUntilCancelled := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := fx.insert(ctx, tx, m); err != nil {
			return err
		}
		select {
		case started <- m.ID:
		default:
		}
		<-ctx.Done()
		cancelled.Store(true)
		return ctx.Err()
	}
	cfg := kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor(),
		Scheduling: consumer.Scheduling{ShutdownTimeout: shutdown}, Reader: tuneReader}
	a, err := kafkainbox.New(cfg, holdUntilCancelled)
	require.NoError(t, err)
	stopA, exitedA := consumertest.Start(t, a)
	publish(t, brokers, topic, events("cut", 0, 1, 1)...)
	var heldID string
	select {
	case heldID = <-started:
	case <-time.After(60 * time.Second):
		t.Fatal("A did not start the handler it holds")
	}

	go stopA() // A stops with its handler in flight, and waits for it
	var runsB atomic.Int64
	stopB := start(t, kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor()},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			runsB.Add(1)
			return fx.insert(ctx, tx, m)
		})
	joined := time.Now()
	select {
	case <-exitedA:
	case <-time.After(shutdown / 5):
		t.Fatalf("A's shutdown still waits for its handler %s after B joined; the rebalance should have cut it", time.Since(joined).Round(time.Second))
	}
	took := time.Since(joined)
	require.True(t, cancelled.Load(), "A's handler was cancelled in flight, not finished")
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) == 1 }, "B runs the message A's handler left")
	waitNoLag(t, brokers, group, topic)
	stopB()
	fx.assertExactlyOnce(t, 1)
	require.EqualValues(t, 1, runsB.Load(), "B's runs")
	t.Logf("A's Run returned %s after B joined (ShutdownTimeout %s); B ran %s", took.Round(100*time.Millisecond), shutdown, heldID)
}
