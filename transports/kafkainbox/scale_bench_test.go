package kafkainbox_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest/testproc"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// The scaling benchmarks' sizes: a run drains scaleBacklog events, then
// answers scalePaced events produced one at a time at scaleRate per second.
var (
	scaleBacklog = sizedInt(20000, 500)
	scalePaced   = sizedInt(600, 60)
	scaleRounds  = sizedInt(3, 1)
)

const scaleRate = 200 // paced events per second

// sizedInt returns full, or small under JUSTONCE_BENCH_SMALL=1.
func sizedInt(full, small int) int {
	if os.Getenv("JUSTONCE_BENCH_SMALL") == "1" {
		return small
	}
	return full
}

// scaleTable is the scaling benchmarks' effect: one row per event, with
// the time its producer sent it (in the message's first 8 bytes) and the
// database's clock at the handler's INSERT, inside the ledger's
// transaction.
const scaleTable = `CREATE TABLE effects (event_id text NOT NULL, sent_ns bigint NOT NULL, done_at timestamptz NOT NULL DEFAULT clock_timestamp())`

// scaleConsumer is a Consumer with the defaults (and the tests' quicker
// group timings, tuneReader) whose handler writes the scaleTable row.
func scaleConsumer(brokers []string, topic, group string, ledger *inbox.Ledger) (*kafkainbox.Consumer, error) {
	return kafkainbox.New(kafkainbox.Config{
		Brokers: brokers, Topic: topic, GroupID: group, Reader: tuneReader,
		Processor: consumer.Config{Ledger: ledger},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, sent_ns) VALUES ($1, $2)`,
			m.ID, int64(binary.BigEndian.Uint64(m.Value)))
		return err
	})
}

// stamped is an event whose value starts with the time it is made.
func stamped(id string, key int) kafka.Message {
	v := make([]byte, 64)
	binary.BigEndian.PutUint64(v, uint64(time.Now().UnixNano()))
	return kafkainbox.NewMessage(id, []byte("k"+strconv.Itoa(key)), v)
}

// scaleResult is one run: the drain's rate (events/s) and the paced
// events' latencies, from before the produce call to the handler's INSERT.
type scaleResult struct {
	rate float64
	lat  []time.Duration
}

// scaleRun measures consumers of group on topic, which the caller has
// started and which have joined with their partitions (the group is
// stable): it publishes one event per partition and waits until they are
// handled, then publishes scaleBacklog events at once, holding the
// handlers back until all are published, and times their drain from the
// first effect to the last (database clock); then it produces scalePaced
// events one at a time, scaleRate per second, and reads their latencies.
// It empties the tables first, and fails unless every event took effect
// once.
func scaleRun(b *testing.B, pg *testsvc.PG, brokers []string, topic string, partitions int) scaleResult {
	b.Helper()
	pg.Exec(b, `TRUNCATE effects, processed_events`)
	// One event per partition first, handled before the backlog: a topic
	// created just now answers its first produce requests slowly, and
	// every partition's path through the consumer is then warm.
	warm := make([]kafka.Message, partitions)
	for i := range warm {
		warm[i] = stamped("w-"+strconv.Itoa(i), i)
	}
	write(b, brokers, topic, &kafka.RoundRobin{}, warm)
	waitEffects(b, pg, "w-%", partitions)
	msgs := make([]kafka.Message, scaleBacklog)
	for i := range msgs {
		msgs[i] = stamped("d-"+strconv.Itoa(i), i)
	}
	// The handlers wait at their INSERT until all are published: the
	// drain measures the consumers, not the producer.
	ctx := context.Background()
	hold, err := pg.Pool.Begin(ctx)
	require.NoError(b, err)
	defer hold.Rollback(ctx) //nolint:errcheck
	_, err = hold.Exec(ctx, `LOCK TABLE effects IN EXCLUSIVE MODE`)
	require.NoError(b, err)
	publish(b, brokers, topic, msgs...)
	require.NoError(b, hold.Commit(ctx))
	waitEffects(b, pg, "d-%", scaleBacklog)
	var first, last time.Time
	require.NoError(b, pg.Pool.QueryRow(ctx, `SELECT min(done_at), max(done_at) FROM effects WHERE event_id LIKE 'd-%'`).Scan(&first, &last))
	res := scaleResult{rate: float64(scaleBacklog) / last.Sub(first).Seconds()}

	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, Balancer: &kafka.Hash{}, RequiredAcks: kafka.RequireAll,
		BatchSize: 1, BatchTimeout: time.Millisecond, Transport: tr}
	defer w.Close()
	tick := time.NewTicker(time.Second / scaleRate)
	defer tick.Stop()
	for i := 0; i < scalePaced; i++ {
		<-tick.C
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		require.NoError(b, w.WriteMessages(wctx, stamped("p-"+strconv.Itoa(i), i%partitions)))
		cancel()
	}
	waitEffects(b, pg, "p-%", scalePaced)
	// Every event once: the measurement counts what exactly-once costs.
	require.Equal(b, partitions+scaleBacklog+scalePaced, pg.Count(b, `SELECT count(*) FROM effects`), "effects")
	require.Equal(b, partitions+scaleBacklog+scalePaced, pg.Count(b, `SELECT count(DISTINCT event_id) FROM effects`), "events")
	rows, err := pg.Pool.Query(ctx, `SELECT (extract(epoch FROM done_at) * 1e9)::bigint - sent_ns FROM effects WHERE event_id LIKE 'p-%'`)
	require.NoError(b, err)
	ns, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(b, err)
	for _, d := range ns {
		res.lat = append(res.lat, time.Duration(d))
	}
	return res
}

// waitEffects waits (up to 2 minutes) for n effects of IDs LIKE pattern.
func waitEffects(b *testing.B, pg *testsvc.PG, pattern string, n int) {
	b.Helper()
	testsvc.Eventually(b, 2*time.Minute, func() bool {
		return pg.Count(b, `SELECT count(*) FROM effects WHERE event_id LIKE $1`, pattern) >= n
	}, "%d effects of %s", n, pattern)
}

// waitStable waits (up to 2 minutes) until group is stable with members
// members that share all partitions of its topic.
func waitStable(b *testing.B, brokers []string, group string, members, partitions int) {
	b.Helper()
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 5 * time.Second}
	testsvc.Eventually(b, 2*time.Minute, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		res, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
		if err != nil || len(res.Groups) != 1 {
			return false
		}
		g := res.Groups[0]
		if g.GroupState != "Stable" || len(g.Members) != members {
			return false
		}
		assigned := 0
		for _, m := range g.Members {
			n := 0
			for _, tp := range m.MemberAssignments.Topics {
				n += len(tp.Partitions)
			}
			if n == 0 {
				return false
			}
			assigned += n
		}
		return assigned == partitions
	}, "group %s stable with %d members", group, members)
}

// dropTopic deletes topic and its dead-letter topic when the benchmark
// ends: the scaling benchmarks make many partitions.
func dropTopic(b *testing.B, brokers []string, topic string) {
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
		if _, err := client.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic, topic + kafkainbox.DeadLetterSuffix}}); err != nil {
			b.Logf("delete topic %s: %v", topic, err)
		}
	})
}

// scaleSizes measures run for each size, interleaved: scaleRounds rounds,
// each running every size once, rotating which goes first, so that outside
// load slows them alike. It reports, per size, events/s of the drain,
// the paced events' p50 and p99, and the ratio of its drain rate to the
// first size's (the median over rounds).
func scaleSizes(b *testing.B, unit string, sizes []int, run func(size, round int) scaleResult) {
	res := make([][]scaleResult, len(sizes))
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		for r := 0; r < scaleRounds; r++ {
			for k := range sizes {
				v := (r + k) % len(sizes)
				res[v] = append(res[v], run(sizes[v], n*scaleRounds+r))
			}
		}
	}
	b.StopTimer()
	for v, size := range sizes {
		var lat []time.Duration
		var sum float64
		ratios := make([]float64, len(res[v]))
		for r, x := range res[v] {
			lat = append(lat, x.lat...)
			sum += x.rate
			ratios[r] = x.rate / res[0][r].rate
		}
		slices.Sort(lat)
		sort.Float64s(ratios)
		name := fmt.Sprintf("%s=%d-", unit, size)
		b.ReportMetric(sum/float64(len(res[v])), name+"ev/s")
		b.ReportMetric(float64(quantile(lat, 50).Microseconds())/1000, name+"p50-ms")
		b.ReportMetric(float64(quantile(lat, 99).Microseconds())/1000, name+"p99-ms")
		if v > 0 {
			b.ReportMetric(ratios[len(ratios)/2], name+"ratio")
		}
	}
}

// BenchmarkScalePartitions: how a default Consumer (one process) scales
// with the partitions of its topic: 1, 4, 16 and 64, interleaved in rounds
// (3, 1 under JUSTONCE_BENCH_SMALL=1; each a fresh topic and group). A
// run waits for the group to hold its partitions and for one event per
// partition to be handled, publishes 20,000 events (500 small) at once,
// holding the handlers back until all are published (a lock on the effect
// table), and times their drain from the first effect to the last, by the
// database's clock; then it produces
// 600 events (60 small) one at a time, 200 per second, each stamped with
// its send time, and reads their latencies to the handler's INSERT.
//
// Metrics per size: events/s of the drain (the mean over rounds), p50 and
// p99 of the paced events (all rounds), and the drain's rate against 1
// partition's in the same round (the median over rounds).
func BenchmarkScalePartitions(b *testing.B) {
	brokers := testsvc.KafkaBrokers(b)
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, scaleTable)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	scaleSizes(b, "partitions", []int{1, 4, 16, 64}, func(partitions, _ int) scaleResult {
		topic := newTopic(b, brokers, partitions)
		dropTopic(b, brokers, topic)
		group := testsvc.Unique("scale")
		c, err := scaleConsumer(brokers, topic, group, ledger)
		require.NoError(b, err)
		ctx, cancel := context.WithCancel(context.Background())
		ran := make(chan error, 1)
		go func() { ran <- c.Run(ctx) }()
		defer func() {
			cancel()
			require.NoError(b, <-ran)
		}()
		waitStable(b, brokers, group, 1, partitions)
		return scaleRun(b, pg, brokers, topic, partitions)
	})
}

// envScaleChild holds, in a child process of BenchmarkScaleProcesses, its
// scaleChild as JSON: TestMain runs the child's part when it is set.
const envScaleChild = "JUSTONCE_KAFKAINBOX_SCALE_CHILD"

// scaleChild is what a child process of BenchmarkScaleProcesses runs: a
// scaleConsumer of Group on Topic, in Schema.
type scaleChild struct {
	DB, Schema   string
	Brokers      []string
	Topic, Group string
}

// scaleChildLimit is the longest a child runs: it never outlives its
// benchmark.
const scaleChildLimit = 5 * time.Minute

// runScaleChild plays a child's part when envScaleChild is set, and ends
// the process: status 0 when its consumer stopped on SIGTERM. It returns
// at once in any other process.
func runScaleChild() {
	v := os.Getenv(envScaleChild)
	if v == "" {
		return
	}
	err := func() error {
		var spec scaleChild
		if err := json.Unmarshal([]byte(v), &spec); err != nil {
			return err
		}
		ctx, cancel := testproc.Context(scaleChildLimit)
		defer cancel()
		cfg, err := pgxpool.ParseConfig(spec.DB)
		if err != nil {
			return err
		}
		cfg.MaxConns = 8
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return err
		}
		defer pool.Close()
		ledger, err := inbox.New(pool, inbox.Config{Schema: spec.Schema})
		if err != nil {
			return err
		}
		c, err := scaleConsumer(spec.Brokers, spec.Topic, spec.Group, ledger)
		if err != nil {
			return err
		}
		return c.Run(ctx)
	}()
	if err != nil {
		fmt.Fprintln(os.Stderr, "scale child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// BenchmarkScaleProcesses: how consumption scales with consumer processes
// in one group: 1, 2 and 4 child processes of the test binary, each a
// default Consumer with a pool of 8 connections, on a topic of 16
// partitions, interleaved in rounds as BenchmarkScalePartitions, whose run
// (drain, then paced events) it shares. A run starts its processes, waits
// until the group is stable with all of them holding partitions, measures,
// and stops them with SIGTERM (each also ends by itself after 5 minutes).
//
// Metrics per size: events/s of the drain across the processes, p50 and
// p99 of the paced events, and the drain's rate against 1 process's in the
// same round.
func BenchmarkScaleProcesses(b *testing.B) {
	brokers := testsvc.KafkaBrokers(b)
	pg := testsvc.Postgres(b, testsvc.MaxConns(4))
	pg.Exec(b, scaleTable)
	const partitions = 16
	scaleSizes(b, "processes", []int{1, 2, 4}, func(procs, round int) scaleResult {
		topic := newTopic(b, brokers, partitions)
		dropTopic(b, brokers, topic)
		child := scaleChild{DB: pg.URL, Schema: pg.Schema, Brokers: brokers, Topic: topic, Group: testsvc.Unique("scale")}
		spec, err := json.Marshal(child)
		require.NoError(b, err)
		ps := make([]*testproc.Proc, procs)
		for i := range ps {
			ps[i] = testproc.Start(b, fmt.Sprintf("consumer %d of %d (round %d)", i+1, procs, round),
				[]string{envScaleChild + "=" + string(spec)}, testproc.RunNone)
		}
		defer func() {
			for _, p := range ps {
				if err := p.Stop(30 * time.Second); err != nil {
					b.Errorf("%v\n%s", err, strings.TrimSpace(p.Output()))
				}
			}
		}()
		waitStable(b, brokers, child.Group, procs, partitions)
		return scaleRun(b, pg, brokers, topic, partitions)
	})
}
