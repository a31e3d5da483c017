package franzinbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/franzinbox"
)

// Records of an aborted transaction, which end the partitions, are neither
// run nor counted by a replay, and the replay still finds each partition's
// end. (What every front's replay must do is the conformance suite's.)
func TestReplayPassesAbortedTransactions(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 3)
	const n = 60
	publish(t, brokers, topic, events("p", 0, n, 20)...)
	abortTxn(t, brokers, topic, events("aborted", 0, 30, 20))
	c, err := franzinbox.New(franzinbox.Config{Brokers: brokers, Topics: []string{topic}, GroupID: "g-" + topic, Processor: fx.processor()}, fx.insert)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, dry := range []bool{true, false} {
		rep, err := c.Replay(ctx, franzinbox.ReplayConfig{}, consumer.ReplayOptions{DryRun: dry})
		require.NoError(t, err, "dry run %v", dry)
		require.EqualValues(t, n, rep.Total.Seen, "dry run %v: the aborted records are not counted", dry)
		require.EqualValues(t, n, rep.Total.Ran, "dry run %v", dry)
		require.Len(t, rep.Partitions, 3, "dry run %v", dry)
	}
	fx.assertExactlyOnce(t, n)
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id LIKE 'aborted-%'`), "aborted records never ran")
}

// abortTxn produces recs to topic in a transaction and aborts it.
func abortTxn(t testing.TB, brokers []string, topic string, recs []*kgo.Record) {
	t.Helper()
	cl := producer(t, brokers, kgo.TransactionalID(testsvc.Unique("txn")), kgo.DefaultProduceTopic(topic))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, cl.BeginTransaction())
	require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
	require.NoError(t, cl.EndTransaction(ctx, kgo.TryAbort))
}
