package franzinbox_test

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

// A handler that outlives the revoke's wait (half the rebalance timeout)
// is cancelled: its transaction rolls back, its offset is not committed,
// and the member rejoins in time instead of being dropped from the group.
// The event runs again, once, for whoever owns its partition next.
func TestRevokeCancelsAHandlerThatOutlivesTheWait(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	var logs testsvc.LogBuffer
	ledger, err := inbox.New(fx.pg.Pool, inbox.Config{Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	require.NoError(t, err)
	fx.ledger = ledger
	topic := newTopic(t, brokers, 4)
	group := "g-" + topic
	const n = 400
	publish(t, brokers, topic, events("c", 0, n, 40)...)

	var (
		mu       sync.Mutex
		runs     = map[string]int{}
		stuckID  atomic.Pointer[string]
		runsA    atomic.Int64
		canceled = make(chan error, 1)
	)
	handler := func(member *atomic.Int64, stick bool) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			member.Add(1)
			mu.Lock()
			runs[m.ID]++
			mu.Unlock()
			if err := fx.insert(ctx, tx, m); err != nil {
				return err
			}
			if stick && stuckID.CompareAndSwap(nil, &m.ID) {
				<-ctx.Done() // stuck until cancelled
				canceled <- ctx.Err()
				return ctx.Err()
			}
			return nil
		}
	}
	// Eager: every partition, the stuck one's too, is revoked when B joins.
	opts := append(append([]kgo.Opt(nil), fastGroup...), kgo.Balancers(kgo.RangeBalancer()))
	cfg := franzinbox.Config{Brokers: brokers, Topics: []string{topic}, GroupID: group, Processor: fx.processor(), ClientOptions: opts,
		Scheduling: consumer.Scheduling{Concurrency: 1}} // the stuck handler holds up all of A
	stopA := start(t, cfg, handler(&runsA, true))
	testsvc.Eventually(t, 60*time.Second, func() bool { return stuckID.Load() != nil }, "A's handler is stuck")
	require.Zero(t, fx.effects(t), "the stuck handler holds its partition: nothing else of it committed yet")

	var runsB atomic.Int64
	stopB := start(t, cfg, handler(&runsB, false))
	select {
	case err := <-canceled:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(60 * time.Second):
		t.Fatal("the stuck handler was not cancelled by the revoke")
	}
	require.Contains(t, logs.String(), "handlers of revoked partitions still running; cancelling them")
	atRevoke := runsA.Load()
	testsvc.Eventually(t, 90*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n
	}, "all processed by the group")
	waitNoLag(t, brokers, group, topic)
	stopB()
	stopA()

	fx.assertExactlyOnce(t, n)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, 2, runs[*stuckID.Load()], "the stuck event ran again once, after its cancelled attempt")
	require.Greater(t, runsA.Load(), atRevoke, "A stayed in the group and consumed after the revoke")
	require.Positive(t, runsB.Load(), "B consumed")
	require.NotContains(t, logs.String(), "lost=true", "no member was dropped from the group")
}

// A handler that ignores its cancellation does not hold the group's
// rebalance: a second after the revoke cancelled it, the member leaves it
// running and the rebalance completes, so the other partition's events
// run while it still blocks. Its event runs once, after it rolled back.
func TestHandlerIgnoringCancellationDoesNotHoldTheRebalance(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 2)
	group := "g-" + topic
	held := make(chan struct{})
	release := make(chan struct{})
	var once, releaseOnce sync.Once
	releaseIt := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(releaseIt)
	handlerA := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "stuck-0" {
			once.Do(func() {
				close(held)
				<-release // ignores ctx
			})
		}
		return fx.insert(ctx, tx, m)
	}
	opts := append(append([]kgo.Opt(nil), fastGroup...), kgo.Balancers(kgo.RangeBalancer()))
	cfg := franzinbox.Config{Brokers: brokers, Topics: []string{topic}, GroupID: group, Processor: fx.processor(), ClientOptions: opts}
	publishTo(t, brokers, topic, 0, events("stuck", 0, 1, 1)...)
	stopA := start(t, cfg, handlerA)
	select {
	case <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("A did not reach the stuck handler")
	}
	stopB := start(t, cfg, fx.insert)
	adm := admin(t, brokers)
	testsvc.Eventually(t, 60*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		gs, err := adm.DescribeGroups(ctx, group)
		if err != nil {
			return false
		}
		g, ok := gs[group]
		return ok && g.State == "Stable" && len(g.Members) == 2
	}, "the group settles with both members while A's handler still blocks")
	select {
	case <-release:
		t.Fatal("released too early")
	default:
	}
	publishTo(t, brokers, topic, 1, events("free", 0, 10, 10)...)
	testsvc.Eventually(t, 60*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id LIKE 'free-%'`) == 10
	}, "the other partition's events run while A's handler still blocks")
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = 'stuck-0'`), "the stuck event has not committed")
	releaseIt()
	testsvc.Eventually(t, 60*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = 'stuck-0'`) == 1
	}, "the stuck event runs again once released")
	stopA()
	stopB()
	fx.assertExactlyOnce(t, 11)
}
