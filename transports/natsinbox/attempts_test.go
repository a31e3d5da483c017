package natsinbox

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// redeliver makes JetStream deliver the next message of the durable n more
// times without any handler running: a raw member of the durable pulls it
// and lets it go, alternately by Nak (what a draining consumer does with
// what it pulled) and by letting AckWait expire (a member that crashed, or
// a prefetched message that waited too long). It returns the message's
// delivery count after the last pull.
func redeliver(t *testing.T, e *env, stream, durable string, n int) uint64 {
	t.Helper()
	cons, err := e.js.Consumer(context.Background(), stream, durable)
	require.NoError(t, err)
	var nd uint64
	for i := 0; i < n; i++ {
		b, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
		require.NoError(t, err)
		var got int
		for m := range b.Messages() {
			got++
			md, err := m.Metadata()
			require.NoError(t, err)
			require.Greater(t, md.NumDelivered, nd, "a new delivery")
			nd = md.NumDelivered
			if i%2 == 0 {
				require.NoError(t, m.Nak())
			} // else: no ack; JetStream delivers it again after AckWait
		}
		require.NoError(t, b.Error())
		require.Equal(t, 1, got, "pull %d", i)
	}
	return nd
}

// durable creates the durable as Run would, so that a raw member can pull
// from it before the natsinbox consumer starts.
func durable(t *testing.T, e *env, stream, name string, ackWait time.Duration) {
	t.Helper()
	_, err := e.js.CreateOrUpdateConsumer(context.Background(), stream, jetstream.ConsumerConfig{
		Durable: name, AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait, MaxDeliver: -1,
	})
	require.NoError(t, err)
}

// numDelivered is m's JetStream delivery count.
func numDelivered(m *consumer.Message) uint64 {
	if js, ok := m.Raw.(jetstream.Msg); ok {
		if md, err := js.Metadata(); err == nil {
			return md.NumDelivered
		}
	}
	return 0
}

// A message delivered again and again without its handler failing (Naks of
// a draining member, AckWait expiries, a consumer stopped while its handler
// ran and cancelled by the shutdown timeout) is on its first attempt when its
// handler fails for the first time: it is retried, not dead-lettered,
// although JetStream's delivery count is far above MaxAttempts.
func TestRedeliveriesAreNotAttempts(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("redeliv")
	stream := e.stream(t, subject, 0)
	const ackWait = 500 * time.Millisecond
	durable(t, e, stream, "r", ackWait)
	e.publish(t, subject, "evt", []byte("x"))
	require.EqualValues(t, 4, redeliver(t, e, stream, "r", 4))

	pcfg := fx.processor(subject) // MaxAttempts 3
	type hrun struct {
		attempt   int
		delivered uint64
	}
	var (
		mu   sync.Mutex
		runs []hrun
	)
	record := func(m *consumer.Message) int {
		mu.Lock()
		defer mu.Unlock()
		runs = append(runs, hrun{m.Attempt, numDelivered(m)})
		return len(runs)
	}

	// A consumer stopped while the handler runs; the handler outlives the
	// shutdown timeout and is cancelled: not a failure of the handler.
	entered := make(chan struct{})
	c1, err := New(Config{Conn: e.nc, Stream: stream, Durable: "r", AckWait: ackWait, Processor: pcfg,
		Scheduling: consumer.Scheduling{ShutdownTimeout: 200 * time.Millisecond}}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		record(m)
		close(entered)
		<-ctx.Done()
		return ctx.Err()
	})
	require.NoError(t, err)
	stop1 := run(t, c1)
	<-entered
	stop1()

	// The next consumer (same process): the handler fails once, for real.
	c2, err := New(Config{Conn: e.nc, Stream: stream, Durable: "r", AckWait: ackWait, Processor: pcfg}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if record(m) == 2 {
			return errors.New("first real failure")
		}
		return fx.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	run(t, c2)
	testsvc.Eventually(t, 20*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "r")
		return fx.effects(t, "evt") == 1 && ci.NumAckPending == 0 && ci.NumPending == 0
	}, "the event ran after one real failure and was acked")

	require.Empty(t, e.deadLetters(t, subject), "not dead-lettered on its first real failure")
	rec, err := fx.ledger.Lookup(context.Background(), inbox.Key{Scope: subject, ID: "evt"})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusDone, rec.Status)
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, runs, 3)
	require.Equal(t, hrun{1, 5}, runs[0], "after four deliveries without a handler, the first attempt")
	require.Equal(t, 1, runs[1].attempt, "the run cancelled by the drain did not count: the real failure is the first attempt")
	require.Greater(t, runs[1].delivered, uint64(pcfg.MaxAttempts), "JetStream's delivery count is past MaxAttempts")
	require.Equal(t, 2, runs[2].attempt, "retried after the one counted failure")
	require.Equal(t, runs[1].delivered, runs[2].delivered, "retried in place, not redelivered")
	require.Zero(t, attempts.len()-attemptsOther(stream), "a message done is forgotten")
}

// attemptsOther counts the table's entries that belong to other streams
// (other tests run in parallel).
func attemptsOther(stream string) int {
	attempts.mu.Lock()
	defer attempts.mu.Unlock()
	n := 0
	for k := range attempts.byKey {
		if k.stream != stream {
			n++
		}
	}
	return n
}

// A handler that always fails runs exactly MaxAttempts times, whatever
// JetStream's delivery count, also when its consumer is stopped between
// two attempts and another consumer of the process takes the message over;
// then the message is dead-lettered, recorded failed and terminated.
func TestAlwaysFailingRunsMaxAttempts(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("always")
	stream := e.stream(t, subject, 0)
	const ackWait = 500 * time.Millisecond
	durable(t, e, stream, "a", ackWait)
	e.publish(t, subject, "bad", []byte("x"))
	redeliver(t, e, stream, "a", 2)

	pcfg := fx.processor(subject)
	pcfg.MaxAttempts = 4
	// Long enough that the consumer is stopped while it waits to retry.
	pcfg.Backoff = backoff.Backoff{Initial: 2 * time.Second, Max: 2 * time.Second}
	var (
		mu   sync.Mutex
		seen []int // Message.Attempt of each handler run
	)
	failing := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		seen = append(seen, m.Attempt)
		mu.Unlock()
		return errors.New("always fails")
	}
	retried := make(chan struct{}, 10)
	p1 := pcfg
	p1.Hooks.OnRetry = func(*consumer.Message, error) { retried <- struct{}{} }
	c1, err := New(Config{Conn: e.nc, Stream: stream, Durable: "a", AckWait: ackWait, Processor: p1}, failing)
	require.NoError(t, err)
	stop1 := run(t, c1)
	<-retried
	<-retried // the second failure is decided; the consumer waits to retry
	start := time.Now()
	stop1()
	require.Less(t, time.Since(start), pcfg.Backoff.Initial/2, "the wait between attempts ends when the consumer stops")
	mu.Lock()
	require.Equal(t, []int{1, 2}, seen)
	mu.Unlock()

	c2, err := New(Config{Conn: e.nc, Stream: stream, Durable: "a", AckWait: ackWait, Processor: pcfg}, failing)
	require.NoError(t, err)
	run(t, c2)
	testsvc.Eventually(t, 30*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "a")
		return len(e.deadLetters(t, subject)) == 1 && ci.NumAckPending == 0 && ci.NumPending == 0
	}, "dead-lettered and terminated")
	mu.Lock()
	require.Equal(t, []int{1, 2, 3, 4}, seen, "exactly MaxAttempts handler runs")
	mu.Unlock()
	dl := e.deadLetters(t, subject)[0]
	require.Equal(t, "4", dl.Header.Get(consumer.HeaderDLAttempts))
	rec, err := fx.ledger.Lookup(context.Background(), inbox.Key{Scope: subject, ID: "bad"})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusFailed, rec.Status)
}

// Hostile handlers on JetStream: one swallows a SQL error and returns nil
// (its transaction is aborted, COMMIT answers ROLLBACK), one breaks a
// deferred constraint that fails at COMMIT. Neither is acked as done: each
// is a counted failure, runs MaxAttempts times, is dead-lettered, recorded
// failed and terminated, and leaves no effect; the events around them run.
func TestHostileHandlersDeadLettered(t *testing.T) {
	t.Parallel()
	for _, batch := range []int{1, 0, 10} { // off, the default, 10
		t.Run("batch="+strconv.Itoa(batch), func(t *testing.T) {
			t.Parallel()
			e, fx := newEnv(t), newFixture(t)
			subject := testsvc.Unique("hostile")
			stream := e.stream(t, subject, 0)
			fx.pg.Exec(t, `CREATE TABLE parents (id text PRIMARY KEY)`)
			fx.pg.Exec(t, `CREATE TABLE children (parent text REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)`)
			runs := map[string]int{}
			var mu sync.Mutex
			c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "h", Processor: fx.processor(subject), Scheduling: consumer.Scheduling{BatchSize: batch}}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				mu.Lock()
				runs[m.ID]++
				mu.Unlock()
				if err := fx.insert(ctx, tx, m); err != nil {
					return err
				}
				switch m.ID {
				case "swallow":
					_, _ = tx.Exec(ctx, `SELECT 1/0`) // error ignored: "go on"
				case "deferred":
					_, err := tx.Exec(ctx, `INSERT INTO children (parent) VALUES ('missing')`)
					return err // nil: the check waits for COMMIT
				}
				return nil
			})
			require.NoError(t, err)
			ids := []string{"ok-1", "swallow", "ok-2", "deferred", "ok-3"}
			for _, id := range ids {
				e.publish(t, subject, id, []byte(id))
			}
			run(t, c)
			testsvc.Eventually(t, 30*time.Second, func() bool {
				ci := e.consumerInfo(t, stream, "h")
				return len(e.deadLetters(t, subject)) == 2 && ci.NumAckPending == 0 && ci.NumPending == 0
			}, "both hostile events dead-lettered, everything settled")
			for _, id := range []string{"swallow", "deferred"} {
				rec, err := fx.ledger.Lookup(context.Background(), inbox.Key{Scope: subject, ID: id})
				require.NoError(t, err, id)
				require.Equal(t, inbox.StatusFailed, rec.Status, id)
				require.Zero(t, fx.effects(t, id), "%s: no effect", id)
				mu.Lock()
				if batch == 1 {
					require.Equal(t, 3, runs[id], "%s: MaxAttempts handler runs", id)
				} else {
					// Plus, when it shared a transaction with "deferred"
					// (whose COMMIT fails, so that its messages run again
					// one by one), that transaction's run: rolled back,
					// "swallow"'s counted failure with it, so not counted.
					require.Contains(t, []int{3, 4}, runs[id], "%s: MaxAttempts handler runs alone", id)
				}
				mu.Unlock()
			}
			for _, dl := range e.deadLetters(t, subject) {
				require.Equal(t, "3", dl.Header.Get(consumer.HeaderDLAttempts))
			}
			for _, id := range []string{"ok-1", "ok-2", "ok-3"} {
				require.Equal(t, 1, fx.effects(t, id), id)
			}
			require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM children`))
		})
	}
}

func TestAttemptTableBounded(t *testing.T) {
	t.Parallel()
	tb := newAttemptTable(3)
	k := func(seq uint64) attemptKey { return attemptKey{stream: "S", durable: "d", scope: "d", seq: seq} }
	tb.put(k(1), attemptCount{attempt: 2})
	tb.put(k(2), attemptCount{attempt: 3})
	tb.put(k(1), attemptCount{attempt: 1, uncounted: 1}) // a late copy: the higher count stays
	n, ok := tb.get(k(1))
	require.True(t, ok)
	require.Equal(t, attemptCount{attempt: 2, uncounted: 1}, n)
	tb.put(k(3), attemptCount{attempt: 2})
	tb.put(k(4), attemptCount{attempt: 2}) // over the bound: the oldest (2) goes
	require.Equal(t, 3, tb.len())
	_, ok = tb.get(k(2))
	require.False(t, ok, "oldest forgotten: its count starts again at 1")
	_, ok = tb.get(k(1))
	require.True(t, ok, "refreshed by the later put")
	tb.forget(k(1))
	_, ok = tb.get(k(1))
	require.False(t, ok)
	require.Equal(t, 2, tb.len())
	other := k(3)
	other.created = 1 // the same name and sequence in a stream created again
	_, ok = tb.get(other)
	require.False(t, ok)
}

// Hostile handlers mixed into busy batches with the default config: 150
// messages waiting on one subject, four kinds of hostile handler among
// them (an error after a write, a panic after a write, nil returned after
// a swallowed SQL error, a deferred constraint failing at COMMIT). Each is
// rolled back alone, retried in place and dead-lettered after
// MaxAttempts; every good message runs exactly once, in stream order; and
// the hostile messages ran inside shared transactions with good messages
// that committed (the batches were real).
func TestDefaultBatchesIsolateHostileHandlers(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("busy")
	stream := e.stream(t, subject, 0)
	fx.pg.Exec(t, `CREATE TABLE strict (id int, CONSTRAINT strict_once UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)`)
	// Which transaction each effect committed in.
	fx.pg.Exec(t, `ALTER TABLE effects ADD COLUMN xid bigint DEFAULT txid_current()`)
	const n = 150
	hostile := map[int]string{15: "h-error", 45: "h-panic", 75: "h-swallow", 110: "h-deferred"}
	var goodIDs []string
	for i := 0; i < n; i++ {
		id, bad := hostile[i]
		if !bad {
			id = "ok-" + strconv.Itoa(i)
			goodIDs = append(goodIDs, id)
		}
		e.publish(t, subject, id, []byte(id))
	}
	var mu sync.Mutex
	runs := map[string][]int64{} // event ID -> the transaction of each run
	c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "busy", Processor: fx.processor(subject)},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
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
	require.NoError(t, err)
	stop := run(t, c)
	testsvc.Eventually(t, 60*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, "busy")
		return len(e.deadLetters(t, subject)) == len(hostile) && ci.NumAckPending == 0 && ci.NumPending == 0
	}, "every hostile message dead-lettered, everything settled")
	stop()

	require.Equal(t, len(goodIDs), fx.pg.Count(t, `SELECT count(*) FROM effects`), "each good message once, no hostile effect")
	require.Equal(t, len(goodIDs), fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	require.Equal(t, len(hostile), fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'failed'`))
	for _, dl := range e.deadLetters(t, subject) {
		require.Equal(t, "3", dl.Header.Get(consumer.HeaderDLAttempts))
	}
	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT event_id FROM effects ORDER BY n`)
	require.NoError(t, err)
	order, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, goodIDs, order, "stream order kept")

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
