package franzinbox_test

import (
	"context"
	"log/slog"
	"strings"
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

// Two members in one group, with handlers in flight across both
// rebalances: B joins mid-stream, then A leaves mid-stream. The revoke
// callback waits for the handlers in flight and commits what is done
// before the partitions move, so the rebalances redeliver nothing: the
// only duplicates the ledger answers are the records produced twice, and
// no member ever finds an event in flight elsewhere. (A front that commits
// on a timer only, kafkainbox for example, redelivers up to a commit
// interval per moved partition, which the ledger then skips.)
//
// Eager: with an eager balancer every partition is revoked, so the
// partition of the handler A holds at a barrier is; the barrier opens only
// once A's revoke callback is waiting for it, and B starts only after.
// Cooperative: franz-go's default cooperative-sticky balancer, which moves
// only some partitions.
func TestRebalanceRedeliversNothing(t *testing.T) {
	t.Parallel()
	t.Run("Eager", func(t *testing.T) {
		t.Parallel()
		testRebalance(t, true)
	})
	t.Run("Cooperative", func(t *testing.T) {
		t.Parallel()
		testRebalance(t, false)
	})
}

func testRebalance(t *testing.T, eager bool) {
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	var logs testsvc.LogBuffer
	ledger, err := inbox.New(fx.pg.Pool, inbox.Config{Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	require.NoError(t, err)
	fx.ledger = ledger
	topic := newTopic(t, brokers, 6)
	group := "g-" + topic
	const n, again = 3000, 600

	var inFlightElsewhere atomic.Int64
	proc := fx.processor()
	outcome := proc.Hooks.OnOutcome
	proc.Hooks.OnOutcome = func(m *consumer.Message, out inbox.Outcome, took time.Duration) {
		if out.Disposition == inbox.InFlight {
			inFlightElsewhere.Add(1)
		}
		outcome(m, out, took)
	}

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
	opts := fastGroup
	if eager {
		// A longer rebalance timeout than fastGroup's: the revoke waits up
		// to half of it for the held handler before cancelling it, and the
		// test must release it within that time on a loaded machine.
		opts = append(append([]kgo.Opt(nil), fastGroup...), kgo.Balancers(kgo.RangeBalancer()), kgo.RebalanceTimeout(20*time.Second))
	}
	cfg := franzinbox.Config{Brokers: brokers, Topics: []string{topic}, GroupID: group, Processor: proc, Scheduling: consumer.Scheduling{Concurrency: 3}, ClientOptions: opts}

	publish(t, brokers, topic, events("r", 0, n/2, 50)...)
	stopA := start(t, cfg, handler(&runsA, eager))
	releaseHeld := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseHeld) // before stopA's cleanup, should the test fail early
	var heldID string
	if eager {
		select {
		case heldID = <-held:
		case <-time.After(60 * time.Second):
			t.Fatal("A did not reach the handler it holds")
		}
		require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = $1`, heldID), "the held effect is not committed yet")
	} else {
		testsvc.Eventually(t, 60*time.Second, func() bool { return runsA.Load() >= n/10 }, "A progresses")
	}

	stopB := start(t, cfg, handler(&runsB, false))
	publish(t, brokers, topic, events("r", n/2, n, 50)...)
	publish(t, brokers, topic, events("r", 0, again, 50)...) // produced twice
	if eager {
		// A's revoke callback waits for the held handler (among others);
		// B gets nothing until it returns.
		testsvc.Eventually(t, 60*time.Second, func() bool {
			return strings.Contains(logs.String(), "partitions revoked; waiting for their handlers in flight")
		}, "A's partitions are revoked while its handler is held")
		require.False(t, returned.Load(), "A's handler was in flight when its partitions were revoked")
		require.Zero(t, runsB.Load(), "B ran nothing while A's revoke waited")
		releaseHeld()
	}
	testsvc.Eventually(t, 60*time.Second, func() bool { return runsB.Load() >= n/10 }, "B gets partitions and progresses")
	require.Less(t, fx.effects(t), n, "the stream should still be running when A leaves")
	stopA()
	testsvc.Eventually(t, 90*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n
	}, "all processed by the group")
	waitNoLag(t, brokers, group, topic) // the trailing duplicates are acked too
	stopB()

	fx.assertExactlyOnce(t, n)
	require.EqualValues(t, n, runsA.Load()+runsB.Load(), "handler runs (A %d, B %d)", runsA.Load(), runsB.Load())
	require.EqualValues(t, n, fx.executed.Load(), "executed")
	require.EqualValues(t, again, fx.dups.Load(), "duplicates: only the records produced twice, nothing redelivered by a rebalance")
	require.Zero(t, inFlightElsewhere.Load(), "no event was found in flight in the other member")
	t.Logf("A ran %d, B ran %d, duplicates answered %d; held across the revoke: %q", runsA.Load(), runsB.Load(), fx.dups.Load(), heldID)
}
