package franzinbox_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

// fastGroup makes group changes quick in tests: a dead member is noticed
// after 6 s (the broker's minimum session timeout), live members notice a
// rebalance within 300 ms and an idle fetch returns within 300 ms.
var fastGroup = []kgo.Opt{
	kgo.SessionTimeout(6 * time.Second),
	kgo.RebalanceTimeout(6 * time.Second),
	kgo.HeartbeatInterval(300 * time.Millisecond),
	kgo.FetchMaxWait(300 * time.Millisecond),
}

// admin returns a kadm client on brokers, closed when the test ends.
func admin(t testing.TB, brokers []string) *kadm.Client {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return kadm.NewClient(cl)
}

// newTopic creates a fresh topic with partitions partitions, and its
// dead-letter topic.
func newTopic(t testing.TB, brokers []string, partitions int32) string {
	t.Helper()
	name := testsvc.Unique("jf")
	adm := admin(t, brokers)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := adm.CreateTopic(ctx, partitions, 1, nil, name)
	require.NoError(t, err)
	_, err = adm.CreateTopic(ctx, 1, 1, nil, name+franzinbox.DeadLetterSuffix)
	require.NoError(t, err)
	for _, topic := range []string{name, name + franzinbox.DeadLetterSuffix} {
		testsvc.Eventually(t, 30*time.Second, func() bool {
			td, err := adm.ListTopics(ctx, topic)
			if err != nil || td.Error() != nil {
				return false
			}
			d := td[topic]
			if len(d.Partitions) == 0 {
				return false
			}
			for _, p := range d.Partitions {
				if p.Leader < 0 {
					return false
				}
			}
			return true
		}, "topic %s has leaders", topic)
	}
	return name
}

// producer returns a producer client, closed when the test ends.
func producer(t testing.TB, brokers []string, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...), kgo.ProducerLinger(5 * time.Millisecond)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(cl.Close)
	return cl
}

// publish writes recs to topic in order (per partition), keyed records
// hashed to their partition, waiting for all replicas.
func publish(t testing.TB, brokers []string, topic string, recs ...*kgo.Record) {
	t.Helper()
	cl := producer(t, brokers)
	for _, r := range recs {
		r.Topic = topic
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
	cl.Close()
}

// publishTo writes recs, in order, to one partition of topic.
func publishTo(t testing.TB, brokers []string, topic string, partition int32, recs ...*kgo.Record) {
	t.Helper()
	cl := producer(t, brokers, kgo.RecordPartitioner(kgo.ManualPartitioner()))
	for _, r := range recs {
		r.Topic, r.Partition = topic, partition
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, cl.ProduceSync(ctx, recs...).FirstErr())
	cl.Close()
}

// events returns records with IDs prefix-from .. prefix-(to-1), spread over
// keys.
func events(prefix string, from, to, keys int) []*kgo.Record {
	out := make([]*kgo.Record, 0, to-from)
	for i := from; i < to; i++ {
		id := prefix + "-" + strconv.Itoa(i)
		out = append(out, franzinbox.NewRecord(id, []byte("k"+strconv.Itoa(i%keys)), []byte(id)))
	}
	return out
}

// readAll returns every record of topic, up to its current end.
func readAll(t testing.TB, brokers []string, topic string) []*kgo.Record {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ends, err := admin(t, brokers).ListEndOffsets(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, ends.Error())
	left := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) {
		if o.Offset > 0 {
			left[o.Partition] = o.Offset
		}
	})
	if len(left) == 0 {
		return nil
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.ConsumeTopics(topic), kgo.FetchMaxWait(200*time.Millisecond))
	require.NoError(t, err)
	defer cl.Close()
	var out []*kgo.Record
	for len(left) > 0 {
		fs := cl.PollFetches(ctx)
		require.NoError(t, ctx.Err(), "reading %s", topic)
		require.Empty(t, fs.Errors())
		fs.EachRecord(func(r *kgo.Record) {
			out = append(out, r)
			if end, ok := left[r.Partition]; ok && r.Offset+1 >= end {
				delete(left, r.Partition)
			}
		})
	}
	return out
}

// lag returns, per partition, end offset minus the group's committed offset.
func lag(t testing.TB, brokers []string, group, topic string) map[int32]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	adm := admin(t, brokers)
	ends, err := adm.ListEndOffsets(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, ends.Error())
	// A coordinator that is still loading (a broker just started) answers
	// with a retriable error: ask again until the deadline.
	var cs kadm.OffsetResponses
	for {
		if cs, err = adm.FetchOffsetsForTopics(ctx, group, topic); err == nil || !kerr.IsRetriable(err) || ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	require.NoError(t, err)
	out := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) {
		committed := int64(0)
		if c, ok := cs.Lookup(topic, o.Partition); ok && c.Err == nil && c.At > 0 {
			committed = c.At
		}
		out[o.Partition] = o.Offset - committed
	})
	return out
}

// waitNoLag waits until the group has committed every offset of topic.
func waitNoLag(t testing.TB, brokers []string, group, topic string) {
	t.Helper()
	testsvc.Eventually(t, 60*time.Second, func() bool {
		for _, l := range lag(t, brokers, group, topic) {
			if l != 0 {
				return false
			}
		}
		return true
	}, "group %s committed everything of %s: lag %v", group, topic, lag(t, brokers, group, topic))
}

// fixture is one test's schema, ledger and counters.
type fixture struct {
	pg       *testsvc.PG
	ledger   *inbox.Ledger
	runs     atomic.Int64 // handler calls
	executed atomic.Int64 // ledger outcomes Executed
	dups     atomic.Int64 // ledger outcomes Duplicate
}

func newFixture(t testing.TB) *fixture {
	t.Helper()
	pg := testsvc.Postgres(t, testsvc.MaxConns(10))
	// No unique constraint: a doubled effect shows as a second row.
	pg.Exec(t, `CREATE TABLE effects (event_id text NOT NULL, value bytea, part int, off bigint, n bigserial)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	return &fixture{pg: pg, ledger: l}
}

// insert is the business handler: one effect row per run.
func (fx *fixture) insert(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	fx.runs.Add(1)
	_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value, part, off) VALUES ($1, $2, $3, $4)`, m.ID, m.Value, m.Partition, m.Offset)
	return err
}

func (fx *fixture) processor() consumer.Config {
	return consumer.Config{
		Ledger:      fx.ledger,
		MaxAttempts: 3,
		Backoff:     backoff.Backoff{Initial: 5 * time.Millisecond, Max: 20 * time.Millisecond},
		Hooks: consumer.Hooks{
			OnOutcome: func(_ *consumer.Message, out inbox.Outcome, _ time.Duration) {
				switch out.Disposition {
				case inbox.Executed:
					fx.executed.Add(1)
				case inbox.Duplicate:
					fx.dups.Add(1)
				}
			},
		},
	}
}

func (fx *fixture) effects(t testing.TB) int {
	return fx.pg.Count(t, `SELECT count(*) FROM effects`)
}

// assertExactlyOnce checks effects == unique IDs, each once, and the
// ledger's done rows.
func (fx *fixture) assertExactlyOnce(t testing.TB, unique int) {
	t.Helper()
	require.Equal(t, unique, fx.pg.Count(t, `SELECT count(*) FROM effects`), "effects (doubled if more, lost if fewer)")
	require.Equal(t, unique, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`), "distinct effects")
	require.Equal(t, unique, fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'done'`), "ledger rows")
}

// start runs a Consumer until the returned stop is called (or the test
// ends); stop waits for the graceful shutdown.
func start(t testing.TB, cfg franzinbox.Config, h consumer.Handler) (stop func()) {
	t.Helper()
	if cfg.ClientOptions == nil {
		cfg.ClientOptions = fastGroup
	}
	c, err := franzinbox.New(cfg, h)
	require.NoError(t, err)
	stop, _ = consumertest.Start(t, c)
	return stop
}
