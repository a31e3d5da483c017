package franzinbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/franzinbox"
)

// One Consumer reads two topics in one scope: an event published to both
// runs once, and a poison message goes to the dead-letter topic of the
// topic it came from. With Concurrency and ByKey, keys run side by side.
func TestTwoTopicsOneScope(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	orders, refunds := newTopic(t, brokers, 3), newTopic(t, brokers, 2)
	group := "g-" + orders
	const n = 300
	publish(t, brokers, orders, events("e", 0, n, 30)...)
	publish(t, brokers, refunds, events("e", n/2, n+n/2, 30)...) // half of them also in orders
	publish(t, brokers, refunds, franzinbox.NewRecord("poison", []byte("k1"), []byte("bad")))

	stop := start(t, franzinbox.Config{
		Brokers: brokers, Topics: []string{orders, refunds}, GroupID: group, Processor: fx.processor(),
		Scheduling: consumer.Scheduling{Concurrency: 4, Ordering: consumer.ByKey},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "poison" {
			return consumer.Permanent(errors.New("cannot parse"))
		}
		return fx.insert(ctx, tx, m)
	})
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) >= n+n/2 }, "both topics consumed")
	waitNoLag(t, brokers, group, orders)
	waitNoLag(t, brokers, group, refunds)
	stop()

	fx.assertExactlyOnce(t, n+n/2)
	require.EqualValues(t, n/2, fx.dups.Load(), "the events in both topics ran once")
	dl := readAll(t, brokers, refunds+franzinbox.DeadLetterSuffix)
	require.Len(t, dl, 1)
	require.Equal(t, "bad", string(dl[0].Value))
	require.Empty(t, readAll(t, brokers, orders+franzinbox.DeadLetterSuffix))
}
