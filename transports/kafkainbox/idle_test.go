package kafkainbox_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// Quiet partitions hold no place in the buffer the partitions share: with
// room for two messages and five of six partitions quiet, the busy one is
// consumed to its end.
func TestQuietPartitionsDoNotStarveABusyOne(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 6)
	const n = 60
	publishTo(t, brokers, topic, 0, events("busy", 0, n, 1)...)
	cfg := kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: "g-" + topic, Processor: fx.processor(),
		Scheduling: consumer.Scheduling{MaxBuffered: 2, BatchSize: 1, Concurrency: 1}}
	stop := start(t, cfg, fx.insert)
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) == n }, "the busy partition consumed to its end")
	stop()
	fx.assertExactlyOnce(t, n)
}

// A handler that ignores its cancellation does not hold a rebalance: A's
// handler of "stuck" blocks until the test releases it, whatever its
// context says. B joins; A leaves the handler behind and rejoins, so the
// group settles with both members while the handler still blocks (were A
// to wait for it, the coordinator would drop A after the rebalance
// timeout), and the other partition's new events run. Once released, the
// stuck event (whose transaction was cancelled) runs again, and every
// event is done once.
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
	var leftReturned atomic.Bool // the handler left behind has returned
	handlerA := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "stuck" {
			first := false
			once.Do(func() {
				first = true
				close(held)
				<-release
			})
			if first {
				defer leftReturned.Store(true)
			}
		}
		return fx.insert(ctx, tx, m)
	}
	cfg := kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor(), Scheduling: consumer.Scheduling{BatchSize: 1}}
	publishTo(t, brokers, topic, 0, kafkainbox.NewMessage("stuck", nil, []byte("x")))
	stopA := start(t, cfg, handlerA)
	select {
	case <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("A did not reach the stuck handler")
	}
	stopB := start(t, cfg, fx.insert)
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 5 * time.Second}
	testsvc.Eventually(t, 60*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		res, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
		return err == nil && len(res.Groups) == 1 && res.Groups[0].GroupState == "Stable" && len(res.Groups[0].Members) == 2
	}, "the group settles with both members while A's handler still blocks")
	select {
	case <-release:
		t.Fatal("released too early")
	default:
	}
	publishTo(t, brokers, topic, 1, events("free", 0, 10, 10)...)
	testsvc.Eventually(t, 60*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id LIKE 'free-%'`) == 10
	}, "the free partition's events run")
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = 'stuck'`), "the stuck event has not committed")

	// A stops while the handler it left behind still blocks: A leaves the
	// group, and its Run returns only after that handler has. The stuck
	// event's next run (on A or B) waits for the key's lock, which the
	// handler's open transaction holds, and runs once it rolled back.
	stoppedA := make(chan bool, 1)
	go func() {
		stopA()
		stoppedA <- leftReturned.Load()
	}()
	testsvc.Eventually(t, 60*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		res, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
		return err == nil && len(res.Groups) == 1 && res.Groups[0].GroupState == "Stable" && len(res.Groups[0].Members) == 1
	}, "A left the group")
	releaseIt()
	select {
	case returned := <-stoppedA:
		require.True(t, returned, "A's Run returned while a handler it left behind was still running")
	case <-time.After(60 * time.Second):
		t.Fatal("A's Run did not return after its handler did")
	}
	testsvc.Eventually(t, 60*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = 'stuck'`) == 1
	}, "the stuck event runs once the left-behind handler rolled back")
	stopB()
	fx.assertExactlyOnce(t, 11)
}
