package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

type bundle struct {
	pg     *testsvc.PG
	ledger *inbox.Ledger
}

func setup(t *testing.T, cfg inbox.Config, opts ...testsvc.PGOption) *bundle {
	t.Helper()
	pg := testsvc.Postgres(t, opts...)
	pg.Exec(t, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
	l, err := inbox.New(pg.Pool, cfg)
	require.NoError(t, err)
	return &bundle{pg: pg, ledger: l}
}

func req(scope, id string) inbox.Request {
	return inbox.Request{Key: inbox.Key{Scope: scope, ID: id}, Source: inbox.Source("kafka")}
}

// pay is a handler with one business write.
func pay(id string, ran *atomic.Int64) inbox.TxFunc {
	return func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		if ran != nil {
			ran.Add(1)
		}
		_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 100)`, id)
		return inbox.Result{Code: 201, Body: []byte(`{"id":"` + id + `"}`)}, err
	}
}

func TestConcurrentDuplicatesRunOnce(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{}, testsvc.MaxConns(20))
	ctx := context.Background()
	var ran atomic.Int64
	var counts [5]atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	metInFlight := make(chan struct{})
	var once sync.Once
	for i := 0; i < 100; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			out, err := b.ledger.Do(ctx, req("orders", "evt-1"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				// Hold the key until a racer has met it in flight (bounded,
				// so that a broken ledger fails the assertions below rather
				// than hanging).
				select {
				case <-metInFlight:
				case <-time.After(10 * time.Second):
				}
				return pay("p1", &ran)(ctx, tx)
			})
			if err != nil {
				t.Error(err)
				return
			}
			counts[out.Disposition].Add(1)
			if out.Disposition == inbox.InFlight {
				once.Do(func() { close(metInFlight) })
			}
		}()
	}
	close(start)
	wg.Wait()
	require.EqualValues(t, 1, ran.Load(), "handler runs")
	require.EqualValues(t, 1, counts[inbox.Executed].Load())
	require.EqualValues(t, 99, counts[inbox.Duplicate].Load()+counts[inbox.InFlight].Load())
	// The racers really raced: some arrived while the handler held the key.
	require.Positive(t, counts[inbox.InFlight].Load(), "no racer met the key in flight: the run was sequential")
	require.Zero(t, counts[inbox.Mismatch].Load())
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments`))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events`))
}

func TestDuplicateReturnsStoredResult(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("orders", "evt-1")
	r.Fingerprint = []byte("fp1")
	first, err := b.ledger.Do(ctx, r, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ('p1', 5)`)
		return inbox.Result{Code: 201, Header: map[string][]string{"Content-Type": {"application/json"}}, Body: []byte(`{"ok":true}`)}, err
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, first.Disposition)

	var ran atomic.Int64
	dup, err := b.ledger.Do(ctx, r, pay("p2", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, dup.Disposition)
	require.Zero(t, ran.Load())
	require.Equal(t, first.Result, dup.Result)
	require.Equal(t, inbox.StatusDone, dup.Record.Status)
	require.Equal(t, inbox.Source("kafka"), dup.Record.Source)
	require.False(t, dup.Record.CompletedAt.IsZero())

	r.Fingerprint = []byte("fp2")
	mm, err := b.ledger.Do(ctx, r, pay("p3", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Mismatch, mm.Disposition)
	require.Zero(t, ran.Load())
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments`))
}

func TestHandlerErrorAndPanicRollBack(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("orders", "evt-err")
	boom := errors.New("boom")

	_, err := b.ledger.Do(ctx, r, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ('p1', 1)`)
		require.NoError(t, err)
		return inbox.Result{}, fmt.Errorf("wrapped: %w", boom)
	})
	require.ErrorIs(t, err, boom)
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM payments`))
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM processed_events`))

	func() {
		defer func() { require.Equal(t, "kaboom", recover()) }()
		_, _ = b.ledger.Do(ctx, r, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ('p1', 1)`)
			require.NoError(t, err)
			panic("kaboom")
		})
	}()
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM payments`))
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM processed_events`))

	// The handler may not end the ledger's transaction itself.
	_, err = b.ledger.Do(ctx, r, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		return inbox.Result{}, tx.Commit(ctx)
	})
	require.ErrorIs(t, err, inbox.ErrTxOwned)

	var ran atomic.Int64
	out, err := b.ledger.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.EqualValues(t, 1, ran.Load())
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments`))
}

func TestSavepointsInsideHandler(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	out, err := b.ledger.Do(ctx, req("s", "k"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ('kept', 1)`)
		require.NoError(t, err)
		err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
			_, err := sp.Exec(ctx, `INSERT INTO payments VALUES ('undone', 1)`)
			require.NoError(t, err)
			return errors.New("undo this part")
		})
		require.Error(t, err)
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'kept'`))
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'undone'`))
}

func TestTenantIsolation(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	ra := inbox.Request{Key: inbox.Key{Scope: "orders", Tenant: "A", ID: "same"}}
	rb := inbox.Request{Key: inbox.Key{Scope: "orders", Tenant: "B", ID: "same"}}
	outA, err := b.ledger.Do(ctx, ra, pay("pa", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, outA.Disposition)

	_, err = b.ledger.Lookup(ctx, rb.Key)
	require.ErrorIs(t, err, inbox.ErrNotFound, "tenant B must not see tenant A's row")

	outB, err := b.ledger.Do(ctx, rb, pay("pb", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, outB.Disposition)
	require.NotEqual(t, outA.Result.Body, outB.Result.Body)

	recA, err := b.ledger.Lookup(ctx, ra.Key)
	require.NoError(t, err)
	require.Equal(t, `{"id":"pa"}`, string(recA.Result.Body))
}

func TestExpiredRowIsNewAgain(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("orders", "short")
	r.TTL = 300 * time.Millisecond
	var ran atomic.Int64
	_, err := b.ledger.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	out, err := b.ledger.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)

	testsvc.Eventually(t, 5*time.Second, func() bool {
		_, err := b.ledger.Lookup(ctx, r.Key)
		return errors.Is(err, inbox.ErrNotFound)
	}, "row expires")
	// Expired but not yet purged: the key is new again.
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events`))
	out, err = b.ledger.Do(ctx, r, pay("p2", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.EqualValues(t, 2, ran.Load())
	rec, err := b.ledger.Lookup(ctx, r.Key)
	require.NoError(t, err)
	require.Equal(t, 1, rec.Attempts)
}

func TestLeaseTakeoverAfterExpiry(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("payments", "charge-1")
	r.Fingerprint = []byte("fp")

	l1, _, err := b.ledger.AcquireLease(ctx, r, 300*time.Millisecond)
	require.NoError(t, err)
	require.NotNil(t, l1)

	l2, out, err := b.ledger.AcquireLease(ctx, r, time.Second)
	require.NoError(t, err)
	require.Nil(t, l2)
	require.Equal(t, inbox.InFlight, out.Disposition)
	require.Equal(t, inbox.StatusProcessing, out.Record.Status)

	// The holder "crashes": its lease runs out and the key is taken over.
	var l3 *inbox.Lease
	testsvc.Eventually(t, 5*time.Second, func() bool {
		l3, _, err = b.ledger.AcquireLease(ctx, r, time.Second)
		require.NoError(t, err)
		return l3 != nil
	}, "lease taken over")
	require.Greater(t, l3.Token(), l1.Token())

	// The stale holder is fenced off.
	require.ErrorIs(t, l1.Complete(ctx, inbox.Result{Code: 200}), inbox.ErrLeaseLost)
	require.ErrorIs(t, l1.Renew(ctx), inbox.ErrLeaseLost)

	require.NoError(t, l3.Complete(ctx, inbox.Result{Code: 201, Body: []byte("charged")}))
	rec, err := b.ledger.Lookup(ctx, r.Key)
	require.NoError(t, err)
	require.Equal(t, inbox.StatusDone, rec.Status)
	require.Equal(t, 2, rec.Attempts)
	require.Equal(t, l3.Token(), rec.FencingToken)

	dup, err := b.ledger.DoLeased(ctx, r, 0, func(context.Context, int64) (inbox.Result, error) {
		t.Fatal("must not run")
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, dup.Disposition)
	require.Equal(t, "charged", string(dup.Result.Body))
}

func TestDoLeasedRenewsAndReleasesOnError(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("payments", "charge-2")

	// A handler slower than its lease keeps the key through renewals. (The
	// lease is long enough for renewals to keep up on a loaded machine; the
	// handler outlives it more than twice.)
	var ran atomic.Int64
	out, err := b.ledger.DoLeased(ctx, r, time.Second, func(ctx context.Context, token int64) (inbox.Result, error) {
		ran.Add(1)
		deadline := time.Now().Add(2500 * time.Millisecond)
		for time.Now().Before(deadline) {
			l, o, err := b.ledger.AcquireLease(ctx, r, time.Second)
			if err != nil || l != nil || o.Disposition != inbox.InFlight {
				return inbox.Result{}, fmt.Errorf("lease not held: %v %v", err, o.Disposition)
			}
			time.Sleep(100 * time.Millisecond)
		}
		return inbox.Result{Code: 200}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)

	// An error releases the key: the retry runs.
	r2 := req("payments", "charge-3")
	_, err = b.ledger.DoLeased(ctx, r2, 0, func(context.Context, int64) (inbox.Result, error) {
		return inbox.Result{}, errors.New("provider down")
	})
	require.Error(t, err)
	out, err = b.ledger.DoLeased(ctx, r2, 0, func(context.Context, int64) (inbox.Result, error) {
		ran.Add(1)
		return inbox.Result{Code: 200}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.EqualValues(t, 2, ran.Load())
}

func TestLockWaitPollsWithoutHoldingAConnection(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{}, testsvc.MaxConns(2))
	ctx := context.Background()
	r := req("orders", "held")
	lease, _, err := b.ledger.AcquireLease(ctx, r, time.Minute)
	require.NoError(t, err)

	r.LockWait = 200 * time.Millisecond
	start := time.Now()
	out, err := b.ledger.Do(ctx, r, pay("p", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.InFlight, out.Disposition)
	require.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond)

	// While one caller waits, the pool stays free for others.
	r.LockWait = 10 * time.Second
	done := make(chan inbox.Outcome, 1)
	go func() {
		out, err := b.ledger.Do(ctx, r, pay("p", nil))
		require.NoError(t, err)
		done <- out
	}()
	testsvc.Eventually(t, 5*time.Second, func() bool {
		return b.ledger.Counters().InFlight >= 1 && b.pg.Pool.Stat().AcquiredConns() == 0
	}, "waiting caller holds no connection")
	require.NoError(t, lease.Abandon(ctx))
	select {
	case out := <-done:
		require.Equal(t, inbox.Executed, out.Disposition)
	case <-time.After(10 * time.Second):
		t.Fatal("waiting caller did not run after release")
	}
}

func TestDoTxJoinsCallerTransaction(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("orders", "tx-1")

	// Rolled back: neither the effect nor the claim remains.
	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	out, err := b.ledger.DoTx(ctx, tx, r, pay("p1", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM processed_events`))

	require.NoError(t, pgx.BeginFunc(ctx, b.pg.Pool, func(tx pgx.Tx) error {
		out, err := b.ledger.DoTx(ctx, tx, r, pay("p1", nil))
		require.Equal(t, inbox.Executed, out.Disposition)
		return err
	}))
	require.NoError(t, pgx.BeginFunc(ctx, b.pg.Pool, func(tx pgx.Tx) error {
		out, err := b.ledger.DoTx(ctx, tx, r, pay("p1", nil))
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.Equal(t, `{"id":"p1"}`, string(out.Result.Body))
		return err
	}))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments`))
}

func TestDoBatch(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	_, err := b.ledger.Do(ctx, req("orders", "e2"), pay("e2", nil))
	require.NoError(t, err)

	ids := []string{"e1", "e2", "e3", "e1", "e4"}
	reqs := make([]inbox.Request, len(ids))
	for i, id := range ids {
		reqs[i] = req("orders", id)
	}
	var seen []string
	outs, err := b.ledger.DoBatch(ctx, reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
		res := make([]inbox.Result, len(fresh))
		for j, i := range fresh {
			seen = append(seen, ids[i])
			if _, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, ids[i]); err != nil {
				return nil, err
			}
			res[j] = inbox.Result{Body: []byte(ids[i])}
		}
		return res, nil
	})
	require.NoError(t, err)
	require.Equal(t, []string{"e1", "e3", "e4"}, seen)
	got := make([]inbox.Disposition, len(outs))
	for i, o := range outs {
		got[i] = o.Disposition
	}
	require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Duplicate, inbox.Executed, inbox.Duplicate, inbox.Executed}, got)
	require.Equal(t, "e1", string(outs[3].Result.Body))
	require.Equal(t, 4, b.pg.Count(t, `SELECT count(*) FROM payments`))
	rec, err := b.ledger.Lookup(ctx, reqs[2].Key)
	require.NoError(t, err)
	require.Equal(t, "e3", string(rec.Result.Body))

	// A failing batch rolls back whole.
	reqs = []inbox.Request{req("orders", "e5"), req("orders", "e6")}
	_, err = b.ledger.DoBatch(ctx, reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ('e5', 1)`)
		require.NoError(t, err)
		return nil, errors.New("poison")
	})
	require.Error(t, err)
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id IN ('e5','e6')`))
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'e5'`))
}

func TestJanitorDeletesOnlyExpired(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	for i := 0; i < 25; i++ {
		r := req("j", fmt.Sprintf("old-%d", i))
		r.TTL = time.Millisecond
		_, err := b.ledger.Do(ctx, r, func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil })
		require.NoError(t, err)
	}
	for i := 0; i < 10; i++ {
		_, err := b.ledger.Do(ctx, req("j", fmt.Sprintf("new-%d", i)), func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil })
		require.NoError(t, err)
	}
	// A live lease past its retention is not deleted under its holder.
	r := req("j", "leased")
	r.TTL = time.Millisecond
	lease, _, err := b.ledger.AcquireLease(ctx, r, time.Minute)
	require.NoError(t, err)
	require.NotNil(t, lease)

	testsvc.Eventually(t, 5*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE expires_at <= now()`) == 26
	}, "rows expire")
	n, err := b.ledger.Purge(ctx, inbox.JanitorConfig{BatchSize: 7})
	require.NoError(t, err)
	require.EqualValues(t, 25, n)
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id LIKE 'old-%'`))
	require.Equal(t, 10, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id LIKE 'new-%'`))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'leased'`))
}

func TestJanitorOneInstanceAtATime(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("j", "x")
	r.TTL = time.Millisecond
	_, err := b.ledger.Do(ctx, r, func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil })
	require.NoError(t, err)
	testsvc.Eventually(t, 5*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE expires_at <= now()`) == 1
	}, "row expires")

	// Another instance holds the janitor lock: this one deletes nothing.
	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	lockSQL, lockKey := b.ledger.JanitorLockSQL()
	_, err = tx.Exec(ctx, lockSQL, lockKey)
	require.NoError(t, err)
	n, err := b.ledger.Purge(ctx, inbox.JanitorConfig{BatchSize: 10})
	require.ErrorIs(t, err, inbox.ErrJanitorBusy)
	require.Zero(t, n)
	require.NoError(t, tx.Rollback(ctx))

	n, err = b.ledger.Purge(ctx, inbox.JanitorConfig{BatchSize: 10})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
}

func TestInvalidInputRejectedBeforeSQL(t *testing.T) {
	t.Parallel()
	// A pool that cannot connect: validation must fail first.
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	require.NoError(t, err)
	defer pool.Close()
	l, err := inbox.New(pool, inbox.Config{MaxKeyLen: 16})
	require.NoError(t, err)
	ctx := context.Background()
	cases := map[string]inbox.Key{
		"empty scope":   {ID: "x"},
		"empty id":      {Scope: "s"},
		"long id":       {Scope: "s", ID: strings.Repeat("x", 17)},
		"long tenant":   {Scope: "s", Tenant: strings.Repeat("t", 17), ID: "x"},
		"invalid utf-8": {Scope: "s", ID: "\xff\xfe"},
		"nul byte":      {Scope: "s", ID: "a\x00b"},
	}
	for name, k := range cases {
		_, err := l.Do(ctx, inbox.Request{Key: k}, func(context.Context, pgx.Tx) (inbox.Result, error) {
			t.Fatal("must not run")
			return inbox.Result{}, nil
		})
		require.ErrorIs(t, err, inbox.ErrInvalidKey, name)
		var ke *inbox.KeyError
		require.ErrorAs(t, err, &ke, name)
		_, err = l.Lookup(ctx, k)
		require.ErrorIs(t, err, inbox.ErrInvalidKey, name)
	}
	// A valid key reaches the (unreachable) store: a typed store error.
	_, err = l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "s", ID: "ok"}}, func(context.Context, pgx.Tx) (inbox.Result, error) {
		return inbox.Result{}, nil
	})
	require.ErrorIs(t, err, inbox.ErrStore)
	_, err = inbox.New(nil, inbox.Config{})
	require.ErrorIs(t, err, inbox.ErrConfig)
}

func TestReleaseAndRecordFailure(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("orders", "stuck")
	lease, _, err := b.ledger.AcquireLease(ctx, r, time.Hour)
	require.NoError(t, err)
	require.NotNil(t, lease)
	ok, err := b.ledger.Release(ctx, r.Key)
	require.NoError(t, err)
	require.True(t, ok)
	require.ErrorIs(t, lease.Complete(ctx, inbox.Result{}), inbox.ErrLeaseLost)
	out, err := b.ledger.Do(ctx, r, pay("p", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)

	// A dead-lettered key is recorded failed; a done key is left done.
	ok, err = b.ledger.RecordFailure(ctx, req("orders", "poison"), 5, errors.New("bad payload"))
	require.NoError(t, err)
	require.True(t, ok)
	out, err = b.ledger.Do(ctx, req("orders", "poison"), pay("x", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.Equal(t, inbox.StatusFailed, out.Record.Status)
	require.Equal(t, "bad payload", out.Record.Error)
	require.Equal(t, 5, out.Record.Attempts)
	ok, err = b.ledger.RecordFailure(ctx, r, 1, errors.New("late"))
	require.NoError(t, err)
	require.False(t, ok)

	st, err := b.ledger.Stats(ctx)
	require.NoError(t, err)
	require.Len(t, st, 2)
}
