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
	"github.com/justonce/justonce/franzinbox"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
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
		Concurrency: 1} // the stuck handler holds up all of A
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
