package kafkainbox_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// tuneReader makes group changes quick in tests: a dead member is noticed
// after 6 s (the broker's minimum session timeout), live members notice a
// rebalance within 300 ms and an idle fetch returns within 300 ms.
func tuneReader(rc *kafka.ReaderConfig) {
	rc.SessionTimeout = 6 * time.Second
	rc.RebalanceTimeout = 6 * time.Second
	rc.HeartbeatInterval = 300 * time.Millisecond
	rc.JoinGroupBackoff = 200 * time.Millisecond
	rc.MaxWait = 300 * time.Millisecond
}

// newTopic creates a fresh topic with partitions partitions, and its
// dead-letter topic, explicitly on the controller.
func newTopic(t testing.TB, brokers []string, partitions int) string {
	t.Helper()
	name := testsvc.Unique("jo")
	createTopics(t, brokers,
		kafka.TopicConfig{Topic: name, NumPartitions: partitions, ReplicationFactor: 1},
		kafka.TopicConfig{Topic: name + kafkainbox.DeadLetterSuffix, NumPartitions: 1, ReplicationFactor: 1})
	return name
}

func createTopics(t testing.TB, brokers []string, topics ...kafka.TopicConfig) {
	t.Helper()
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	ctrl, err := conn.Controller()
	require.NoError(t, err)
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	require.NoError(t, err)
	defer cc.Close()
	require.NoError(t, cc.CreateTopics(topics...))
	for _, tc := range topics {
		testsvc.Eventually(t, 30*time.Second, func() bool {
			ps, err := conn.ReadPartitions(tc.Topic)
			if err != nil || len(ps) != tc.NumPartitions {
				return false
			}
			for _, p := range ps {
				if p.Leader.Host == "" {
					return false
				}
			}
			return true
		}, "topic %s has leaders", tc.Topic)
	}
}

func partitions(t testing.TB, brokers []string, topic string) []int {
	t.Helper()
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	ps, err := conn.ReadPartitions(topic)
	require.NoError(t, err)
	out := make([]int, len(ps))
	for i, p := range ps {
		out[i] = p.ID
	}
	return out
}

// publish writes msgs in order (per partition), keyed messages hashed to
// their partition, waiting for all replicas.
func publish(t testing.TB, brokers []string, topic string, msgs ...kafka.Message) {
	t.Helper()
	write(t, brokers, topic, &kafka.Hash{}, msgs)
}

// publishTo writes msgs, in order, to one partition of topic.
func publishTo(t testing.TB, brokers []string, topic string, partition int, msgs ...kafka.Message) {
	t.Helper()
	write(t, brokers, topic, kafka.BalancerFunc(func(kafka.Message, ...int) int { return partition }), msgs)
}

func write(t testing.TB, brokers []string, topic string, b kafka.Balancer, msgs []kafka.Message) {
	t.Helper()
	tr := &kafka.Transport{}
	w := &kafka.Writer{
		Addr:         kafka.TCP(brokers...),
		Topic:        topic,
		Balancer:     b,
		RequiredAcks: kafka.RequireAll,
		BatchSize:    1000,
		BatchBytes:   16 << 20,
		BatchTimeout: 5 * time.Millisecond,
		// A transport of its own: the shared one caches metadata for
		// seconds and would not know a topic created just now.
		Transport: tr,
	}
	defer func() {
		_ = w.Close()
		tr.CloseIdleConnections()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, w.WriteMessages(ctx, msgs...))
}

// events returns messages with IDs prefix-from .. prefix-(to-1), spread over
// keys.
func events(prefix string, from, to, keys int) []kafka.Message {
	out := make([]kafka.Message, 0, to-from)
	for i := from; i < to; i++ {
		id := prefix + "-" + strconv.Itoa(i)
		out = append(out, kafkainbox.NewMessage(id, []byte("k"+strconv.Itoa(i%keys)), []byte(id)))
	}
	return out
}

// endOffsets returns, per partition, the offset after the last record of
// topic.
func endOffsets(t testing.TB, brokers []string, topic string) map[int]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	req := &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{}}
	for _, p := range partitions(t, brokers, topic) {
		req.Topics[topic] = append(req.Topics[topic], kafka.LastOffsetOf(p))
	}
	res, err := client.ListOffsets(ctx, req)
	require.NoError(t, err)
	out := map[int]int64{}
	for _, po := range res.Topics[topic] {
		require.NoError(t, po.Error)
		out[po.Partition] = po.LastOffset
	}
	return out
}

// readAll returns every message of topic, partition by partition.
func readAll(t testing.TB, brokers []string, topic string) []kafka.Message {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	parts := partitions(t, brokers, topic)
	req := &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{}}
	for _, p := range parts {
		req.Topics[topic] = append(req.Topics[topic], kafka.FirstOffsetOf(p), kafka.LastOffsetOf(p))
	}
	res, err := client.ListOffsets(ctx, req)
	require.NoError(t, err)
	var out []kafka.Message
	for _, po := range res.Topics[topic] {
		require.NoError(t, po.Error)
		if po.LastOffset <= po.FirstOffset {
			continue
		}
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: po.Partition, MaxWait: 200 * time.Millisecond})
		require.NoError(t, r.SetOffset(po.FirstOffset))
		for {
			m, err := r.ReadMessage(ctx)
			require.NoError(t, err)
			out = append(out, m)
			if m.Offset+1 >= po.LastOffset {
				break
			}
		}
		require.NoError(t, r.Close())
	}
	return out
}

// lag returns, per partition, end offset minus the group's committed offset.
func lag(t testing.TB, brokers []string, group, topic string) map[int]int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	ends := endOffsets(t, brokers, topic)
	parts := make([]int, 0, len(ends))
	for p := range ends {
		parts = append(parts, p)
	}
	var err error
	// A group coordinator that is moving or still loading answers with a
	// retriable error: ask again, within ctx.
	var cs *kafka.OffsetFetchResponse
	for {
		cs, err = client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: parts}})
		if err == nil {
			err = cs.Error
		}
		var ke kafka.Error
		if err == nil || !errors.As(err, &ke) || !ke.Temporary() || ctx.Err() != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	require.NoError(t, err)
	committed := map[int]int64{}
	for _, p := range cs.Topics[topic] {
		require.NoError(t, p.Error)
		committed[p.Partition] = max(p.CommittedOffset, 0)
	}
	out := map[int]int64{}
	for p, end := range ends {
		out[p] = end - committed[p]
	}
	return out
}

// waitNoLag waits until the group has committed every offset of topic.
// logGroup logs the group's state and each member's partitions, and the
// lag of each partition, for a test that failed.
func logGroup(t testing.TB, brokers []string, group string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 5 * time.Second}
	res, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
	if err != nil {
		t.Logf("group %s: %v", group, err)
		return
	}
	for _, g := range res.Groups {
		t.Logf("group %s: state %s, %d members, error %v", g.GroupID, g.GroupState, len(g.Members), g.Error)
		for _, m := range g.Members {
			var parts []int
			for _, tp := range m.MemberAssignments.Topics {
				parts = append(parts, tp.Partitions...)
			}
			t.Logf("  member %s (%s): partitions %v", m.MemberID, m.ClientHost, parts)
		}
	}
}

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

func requireNoLag(t testing.TB, brokers []string, group, topic string) {
	t.Helper()
	for p, l := range lag(t, brokers, group, topic) {
		require.Zero(t, l, "partition %d: committed offset behind the end: %d messages not acked", p, l)
	}
}

// fixture is one test's schema, ledger and counters.
type fixture struct {
	pg        *testsvc.PG
	ledger    *inbox.Ledger
	runs      atomic.Int64 // handler calls
	executed  atomic.Int64 // ledger outcomes Executed
	dups      atomic.Int64 // ledger outcomes Duplicate
	deadLetts atomic.Int64
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
			OnDeadLetter: func(*consumer.Message, error) { fx.deadLetts.Add(1) },
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
func start(t testing.TB, cfg kafkainbox.Config, h consumer.Handler) (stop func()) {
	t.Helper()
	if cfg.Reader == nil {
		cfg.Reader = tuneReader
	}
	c, err := kafkainbox.New(cfg, h)
	require.NoError(t, err)
	stop, _ = consumertest.Start(t, c)
	return stop
}
