package franzinbox_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/franzinbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// A transactional producer aborts a transaction and then produces the same
// events again in a transaction it commits, between plain records and
// another committed transaction. The log holds the aborted records (a
// read-uncommitted reader finds them); the Consumer never runs them: each
// event has the effect of its committed copy, once. kafkainbox, on the
// same topic, runs the aborted copies (kafka-go delivers records of
// aborted transactions), so its effects carry the aborted values and the
// committed copies are answered as duplicates.
func TestAbortedTransactionsAreNeverDelivered(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	topic := newTopic(t, brokers, 1)
	const perTxn = 20

	txn := producer(t, brokers,
		kgo.TransactionalID(testsvc.Unique("txn")),
		kgo.TransactionTimeout(10*time.Second),
		kgo.DefaultProduceTopic(topic))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	produceTxn := func(commit kgo.TransactionEndTry, prefix, value string) {
		t.Helper()
		require.NoError(t, txn.BeginTransaction())
		for i := range perTxn {
			id := prefix + "-" + strconv.Itoa(i)
			require.NoError(t, txn.ProduceSync(ctx, franzinbox.NewRecord(id, nil, []byte(value))).FirstErr())
		}
		require.NoError(t, txn.EndTransaction(ctx, commit))
	}
	publish(t, brokers, topic, events("plain", 0, perTxn, 1)...)
	produceTxn(kgo.TryCommit, "first", "committed")
	produceTxn(kgo.TryAbort, "retried", "aborted")    // the producer gave up on these ...
	produceTxn(kgo.TryCommit, "retried", "committed") // ... and produced them again
	produceTxn(kgo.TryAbort, "never", "aborted")      // these never made it
	publish(t, brokers, topic, events("plain", perTxn, 2*perTxn, 1)...)
	const want = 4 * perTxn // plain 40, first 20, retried 20

	// The aborted records are in the log.
	aborted := 0
	for _, r := range readAll(t, brokers, topic) {
		if string(r.Value) == "aborted" {
			aborted++
		}
	}
	require.Equal(t, 2*perTxn, aborted, "aborted records in the log, read uncommitted")

	t.Run("franzinbox", func(t *testing.T) {
		fx := newFixture(t)
		group := "g-franz-" + topic
		stop := start(t, franzinbox.Config{Brokers: brokers, Topics: []string{topic}, GroupID: group, Processor: fx.processor()}, fx.insert)
		waitNoLag(t, brokers, group, topic) // every offset done, markers and aborted records included
		stop()
		fx.assertExactlyOnce(t, want)
		require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE value = 'aborted'`), "effects of aborted records")
		require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id LIKE 'never-%'`), "events only ever aborted")
		require.Equal(t, perTxn, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id LIKE 'retried-%' AND value = 'committed'`), "retried events have their committed effect")
		require.EqualValues(t, want, fx.runs.Load(), "handler runs")
		require.Zero(t, fx.dups.Load(), "no duplicates: the aborted copies never came")
	})

	t.Run("kafkainbox", func(t *testing.T) {
		fx := newFixture(t)
		group := "g-kafka-go-" + topic
		c, err := kafkainbox.New(kafkainbox.Config{
			Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor(),
			Reader: func(rc *kafka.ReaderConfig) {
				rc.IsolationLevel = kafka.ReadCommitted
				rc.MaxWait = 300 * time.Millisecond
			},
		}, fx.insert)
		require.NoError(t, err)
		stop, _ := consumertest.Start(t, c)
		waitNoLag(t, brokers, group, topic)
		stop()
		abortedRuns := fx.pg.Count(t, `SELECT count(*) FROM effects WHERE value = 'aborted'`)
		t.Logf("kafkainbox (kafka-go, ReadCommitted): %d effects of aborted records, %d committed copies answered as duplicates", abortedRuns, fx.dups.Load())
		require.Equal(t, 2*perTxn, abortedRuns, "kafka-go delivers the records of aborted transactions")
	})
}

// Records of an aborted transaction, which end the partitions, are neither
// run nor counted by a replay, and the replay still finds each partition's
// end: what this front's replay adds to the suite's Replay case.
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
