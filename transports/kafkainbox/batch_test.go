package kafkainbox_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
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

// Batch mode keeps the guarantees: duplicates (in a batch, across batches,
// after a restart) run once, poison messages in a batch are dead-lettered
// alone while the rest of their batch commits, and every offset is acked.
func TestBatchModeGuarantees(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 4)
	group := "g-" + topic
	const n, dups = 3000, 600

	msgs := events("b", 0, n, 30)
	var poison []kafka.Message
	for i, at := range []int{100, 1500, 2900} {
		p := kafkainbox.NewMessage("poison-"+string(rune('a'+i)), msgs[at].Key, []byte("bad"))
		poison = append(poison, p)
		msgs = append(msgs[:at:at], append([]kafka.Message{p}, msgs[at:]...)...)
	}
	publish(t, brokers, topic, msgs...)
	again := make([]kafka.Message, 0, dups)
	for i := 0; i < dups; i++ {
		again = append(again, events("b", i*5, i*5+1, 30)...)
	}
	publish(t, brokers, topic, again...)

	var (
		dupRuns atomic.Int64 // handler runs for an ID whose effect had committed
		mu      sync.Mutex
		lastTx  pgx.Tx
		streak  int
		longest int // most handler calls in one transaction
	)
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		if tx == lastTx {
			streak++
		} else {
			lastTx, streak = tx, 1
		}
		longest = max(longest, streak)
		mu.Unlock()
		if strings.HasPrefix(m.ID, "poison-") {
			return errors.New("bad payload")
		}
		var done bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM effects WHERE event_id = $1)`, m.ID).Scan(&done); err != nil {
			return err
		}
		if done {
			dupRuns.Add(1)
		}
		return fx.insert(ctx, tx, m)
	}
	cfg := kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor(), Scheduling: consumer.Scheduling{BatchSize: 100}}

	// First run, stopped gracefully mid-stream.
	stop := start(t, cfg, handler)
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) >= n/3 }, "first run progresses")
	stop()
	require.Less(t, fx.effects(t), n, "stopped mid-stream")

	// Second run, two batches at a time, to the end.
	cfg.Concurrency = 2
	stop = start(t, cfg, handler)
	testsvc.Eventually(t, 90*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n
	}, "everything processed")
	waitNoLag(t, brokers, group, topic)
	stop()

	fx.assertExactlyOnce(t, n)
	require.Zero(t, dupRuns.Load(), "the handler ran for an event already done")
	require.Greater(t, longest, 10, "messages ran in shared transactions (batches)")
	require.GreaterOrEqual(t, fx.dups.Load(), int64(dups), "duplicates answered")

	dl := readAll(t, brokers, topic+kafkainbox.DeadLetterSuffix)
	require.Len(t, dl, len(poison))
	for _, d := range dl {
		h := map[string]string{}
		for _, hd := range d.Headers {
			h[hd.Key] = string(hd.Value)
		}
		require.True(t, strings.HasPrefix(h[consumer.HeaderDLID], "poison-"))
		require.Equal(t, "3", h[consumer.HeaderDLAttempts])
		require.Contains(t, h[consumer.HeaderDLError], "bad payload")
	}
	require.Equal(t, len(poison), fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'failed'`))
}

// Hostile handlers mixed into busy batches with the default config: 200
// messages of one partition waiting, four kinds of hostile handler among
// them (an error after a write, a panic after a write, nil returned after
// a swallowed SQL error, a deferred constraint failing at COMMIT). Each
// hostile message is rolled back alone, retried in place and
// dead-lettered after MaxAttempts; every good message runs exactly once,
// in offset order; and the hostile messages did run inside shared
// transactions with good messages that committed (the batches were real).
func TestDefaultBatchesIsolateHostileHandlers(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	fx.pg.Exec(t, `CREATE TABLE strict (id int, CONSTRAINT strict_once UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)`)
	// Which transaction each effect committed in.
	fx.pg.Exec(t, `ALTER TABLE effects ADD COLUMN xid bigint DEFAULT txid_current()`)
	var mu sync.Mutex
	runs := map[string][]int64{} // event ID -> the transaction of each run
	topic := newTopic(t, brokers, 1)
	group := "g-" + topic
	const n = 200
	hostile := map[int]string{20: "h-error", 60: "h-panic", 100: "h-swallow", 150: "h-deferred"}
	var msgs []kafka.Message
	good := 0
	for i := 0; i < n; i++ {
		if id, ok := hostile[i]; ok {
			msgs = append(msgs, kafkainbox.NewMessage(id, []byte("k"), []byte("bad")))
			continue
		}
		msgs = append(msgs, kafkainbox.NewMessage("ok-"+strconv.Itoa(i), []byte("k"), []byte("ok")))
		good++
	}
	publish(t, brokers, topic, msgs...)

	stop := start(t, kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor()},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			// Which transaction each run was in: a batch shares one.
			var xid int64
			if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&xid); err != nil {
				return err
			}
			mu.Lock()
			runs[m.ID] = append(runs[m.ID], xid)
			mu.Unlock()
			if err := fx.insert(ctx, tx, m); err != nil {
				return err
			}
			switch m.ID {
			case "h-error":
				return errors.New("bad payload")
			case "h-panic":
				panic("handler bug")
			case "h-swallow":
				_, _ = tx.Exec(ctx, `SELECT 1/0`) // ignored
			case "h-deferred":
				_, err := tx.Exec(ctx, `INSERT INTO strict VALUES (1), (1)`)
				return err // nil: the check waits for COMMIT
			}
			return nil
		})
	testsvc.Eventually(t, 90*time.Second, func() bool {
		return fx.effects(t) >= good && len(readAll(t, brokers, topic+kafkainbox.DeadLetterSuffix)) >= len(hostile)
	}, "every good message ran and every hostile one was dead-lettered")
	waitNoLag(t, brokers, group, topic)
	stop()

	fx.assertExactlyOnce(t, good)
	require.Equal(t, len(hostile), fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'failed'`))
	dl := readAll(t, brokers, topic+kafkainbox.DeadLetterSuffix)
	require.Len(t, dl, len(hostile))
	for _, d := range dl {
		h := map[string]string{}
		for _, hd := range d.Headers {
			h[hd.Key] = string(hd.Value)
		}
		require.Equal(t, "3", h[consumer.HeaderDLAttempts], h[consumer.HeaderDLID])
	}
	// Offset order within the partition.
	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT off FROM effects ORDER BY n`)
	require.NoError(t, err)
	offs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	for i := 1; i < len(offs); i++ {
		require.Greater(t, offs[i], offs[i-1], "partition order kept")
	}
	// The batches were real: most good messages shared a transaction with
	// others, and each hostile message's first run, rolled back alone (or,
	// failing at COMMIT, with its batch), shared its transaction with good
	// messages; for the ones that fail inside it, those good messages
	// committed (in that transaction, or run again in the next).
	mu.Lock()
	defer mu.Unlock()
	perTx := map[int64]int{}
	for _, xs := range runs {
		for _, x := range xs {
			perTx[x]++
		}
	}
	biggest := 0
	for _, c := range perTx {
		biggest = max(biggest, c)
	}
	require.Greater(t, biggest, 5, "several messages ran in one transaction")
	// A hostile message at the head of a batch runs alone (the run ends
	// at it); one inside a batch shares its transaction.
	inBusy := 0
	for _, id := range hostile {
		first := runs[id][0]
		committed := fx.pg.Count(t, `SELECT count(*) FROM effects WHERE xid = $1`, first)
		// The good messages that ran in that transaction (before it:
		// the run ends at it).
		var mates []string
		for other, xs := range runs {
			if other != id && slices.Contains(xs, first) {
				mates = append(mates, other)
			}
		}
		matesDone := fx.pg.Count(t, `SELECT count(*) FROM effects WHERE event_id = ANY($1)`, mates)
		t.Logf("%s: first run shared its transaction with %d others (%d committed there, %d committed in all)", id, perTx[first]-1, committed, matesDone)
		if perTx[first] == 1 {
			continue
		}
		inBusy++
		if id == "h-deferred" {
			require.Zero(t, committed, "its batch failed at COMMIT as a whole")
			continue
		}
		// On savepoints they commit in that transaction; on the
		// optimistic way it is rolled back with the failing handler and
		// they run again, on savepoints, in the next: either way each
		// committed, once (assertExactlyOnce), in the same attempt.
		require.Equal(t, len(mates), matesDone, "%s was rolled back alone: the others of its batch committed", id)
	}
	require.GreaterOrEqual(t, inBusy, 2, "hostile messages ran inside busy batches")
}
