package inbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

func reqs(scope string, ids ...string) []inbox.Request {
	out := make([]inbox.Request, len(ids))
	for i, id := range ids {
		out[i] = req(scope, id)
	}
	return out
}

// payEach is an EachFunc with one business write per request, which
// records the transaction each request ran in and checks that the context
// names the request's own key.
func payEach(t *testing.T, rs []inbox.Request, xids []int64, ran *atomic.Int64) inbox.EachFunc {
	return func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		ran.Add(1)
		k, ok := inbox.EventKey(ctx)
		if !ok || k != rs[i].Key {
			t.Errorf("request %d: handler context names %v, want %v", i, k, rs[i].Key)
		}
		if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&xids[i]); err != nil {
			return inbox.Result{}, err
		}
		_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 100)`, rs[i].ID)
		return inbox.Result{Code: 201, Body: []byte(rs[i].ID)}, err
	}
}

// Hostile handlers inside a run: each failure is its request's alone. The
// run ends at it, its write and its claim are rolled back, the requests
// before it commit in one transaction, and the ones after it do not start.
// The run goes first the optimistic way (no savepoint per request), so
// the failure takes that transaction with it: the requests before it run
// again on savepoints and commit, and the failing handler is not called a
// second time for the one failure reported.
func TestDoEachIsolatesAFailingHandlerInItsSavepoint(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		bad   func(ctx context.Context, tx pgx.Tx) error
		check func(t *testing.T, err error)
	}{
		{"swallowed error", func(ctx context.Context, tx pgx.Tx) error {
			_, _ = tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ('bad', 1)`)
			_, _ = tx.Exec(ctx, `SELECT 1/0`) // ignored
			return nil
		}, func(t *testing.T, err error) { require.ErrorIs(t, err, inbox.ErrRolledBack) }},
		{"error returned after a write", func(ctx context.Context, tx pgx.Tx) error {
			_, _ = tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ('bad', 1)`)
			return errors.New("boom")
		}, func(t *testing.T, err error) { require.EqualError(t, err, "boom") }},
		{"nested savepoint left open", func(ctx context.Context, tx pgx.Tx) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			_, _ = sp.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ('bad', 1)`)
			return errors.New("left its savepoint open")
		}, func(t *testing.T, err error) { require.EqualError(t, err, "left its savepoint open") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, inbox.Config{})
			ctx := context.Background()
			rs := reqs("orders", "a", "b", "bad", "c")
			// The transaction of each call of each request's handler.
			xids := make([][]int64, len(rs))
			var ran atomic.Int64
			run, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
				ran.Add(1)
				var xid int64
				if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&xid); err != nil {
					return inbox.Result{}, err
				}
				xids[i] = append(xids[i], xid)
				if rs[i].ID == "bad" {
					return inbox.Result{}, tc.bad(ctx, tx)
				}
				_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 100)`, rs[i].ID)
				return inbox.Result{Code: 201, Body: []byte(rs[i].ID)}, err
			})
			require.NoError(t, err)
			require.Len(t, run.Outcomes, 3, "the run ended at the failing request")
			tc.check(t, run.Failed)
			require.Equal(t, inbox.Executed, run.Outcomes[0].Disposition)
			require.Equal(t, inbox.Executed, run.Outcomes[1].Disposition)
			require.Len(t, xids[2], 1, "one failure, one call of the failing handler")
			require.Empty(t, xids[3], "c did not start")
			require.Len(t, xids[0], 2, "a ran optimistically, then again on savepoints")
			require.Len(t, xids[1], 2, "b too")
			require.Equal(t, []int64{xids[0][0], xids[0][0]}, []int64{xids[1][0], xids[2][0]}, "a, b and bad ran in one transaction first")
			require.Equal(t, xids[0][1], xids[1][1], "a and b then committed in one transaction")
			require.NotEqual(t, xids[0][0], xids[0][1])
			require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM payments`), "a and b committed once, bad's write rolled back")
			require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM processed_events`), "bad's claim rolled back")

			// bad's key is free at once (its lock went with the transaction).
			out, err := b.ledger.Do(ctx, req("orders", "bad"), pay("bad", nil))
			require.NoError(t, err)
			require.Equal(t, inbox.Executed, out.Disposition)
			// Duplicates within and across runs, and a copy in one run.
			rs2 := reqs("orders", "a", "c", "c", "d")
			before := ran.Load()
			run, err = b.ledger.DoEach(ctx, rs2, inbox.EachOptions{}, payEach(t, rs2, make([]int64, 4), &ran))
			require.NoError(t, err)
			require.Nil(t, run.Failed)
			got := []inbox.Disposition{}
			for _, o := range run.Outcomes {
				got = append(got, o.Disposition)
			}
			require.Equal(t, []inbox.Disposition{inbox.Duplicate, inbox.Executed, inbox.Duplicate, inbox.Executed}, got)
			require.Equal(t, []byte("a"), run.Outcomes[0].Result.Body, "the stored result")
			require.Equal(t, []byte("c"), run.Outcomes[2].Result.Body, "the copy answers with its first's result")
			require.EqualValues(t, 2, ran.Load()-before, "c and d ran, once each")
		})
	}
}

// A panic in a handler rolls the whole run back and is re-raised; a
// deferred constraint failing at COMMIT fails the run as a whole (it
// cannot be pinned on one request), not transient; a handler's ROLLBACK
// is refused, and a handler that ends the transaction past the ledger
// fails the run as a whole.
func TestDoEachWholeRunFailures(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	b.pg.Exec(t, `CREATE TABLE parent (id text PRIMARY KEY)`)
	b.pg.Exec(t, `CREATE TABLE child (parent text REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)`)
	ctx := context.Background()
	var ran atomic.Int64

	rs := reqs("p", "a", "boom", "c")
	good := payEach(t, rs, make([]int64, 3), &ran)
	require.PanicsWithValue(t, "handler bug", func() {
		_, _ = b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
			if i == 1 {
				panic("handler bug")
			}
			return good(ctx, tx, i)
		})
	})
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM payments`))
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events`))

	rs = reqs("d", "a", "orphan", "c")
	good = payEach(t, rs, make([]int64, 3), &ran)
	_, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		if i == 1 {
			_, err := tx.Exec(ctx, `INSERT INTO child VALUES ('none')`)
			return inbox.Result{}, err
		}
		return good(ctx, tx, i)
	})
	require.ErrorIs(t, err, inbox.ErrStore)
	require.False(t, inbox.IsTransient(err), "a deferred constraint is the handlers' fault")
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'd'`))

	// A ROLLBACK through the handler's transaction is refused (the ledger
	// owns it): the handler fails alone.
	rs = reqs("e", "a", "ender", "c")
	good = payEach(t, rs, make([]int64, 3), &ran)
	run, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		if i == 1 {
			_, err := tx.Exec(ctx, `ROLLBACK`)
			return inbox.Result{}, err
		}
		return good(ctx, tx, i)
	})
	require.NoError(t, err)
	require.ErrorIs(t, run.Failed, inbox.ErrTxOwned)
	require.Len(t, run.Outcomes, 2)
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'e'`))

	// Ending it past the ledger (on the raw connection) fails the run as a
	// whole.
	rs = reqs("e2", "a2", "ender2", "c2")
	good = payEach(t, rs, make([]int64, 3), &ran)
	_, err = b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		if i == 1 {
			_, err := tx.Conn().Exec(ctx, `ROLLBACK`)
			return inbox.Result{}, err
		}
		return good(ctx, tx, i)
	})
	require.ErrorIs(t, err, inbox.ErrRolledBack)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'e2'`))

	// The ledger still works on the same pool.
	out, err := b.ledger.Do(ctx, req("p", "boom"), pay("boom", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
}

// A run starts no request after MaxTime, nor after Stop is closed.
func TestDoEachBounds(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	var ran atomic.Int64
	rs := reqs("t", "a", "b", "c", "d", "e", "f", "g", "h")
	pay := payEach(t, rs, make([]int64, len(rs)), &ran)
	run, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{MaxTime: 50 * time.Millisecond}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		time.Sleep(20 * time.Millisecond)
		return pay(ctx, tx, i)
	})
	require.NoError(t, err)
	// Three handlers take 60 ms at least: no fourth starts after 50 ms.
	require.NotEmpty(t, run.Outcomes)
	require.LessOrEqual(t, len(run.Outcomes), 3, "stopped starting requests after MaxTime")
	require.Equal(t, len(run.Outcomes), b.pg.Count(t, `SELECT count(*) FROM payments`), "what ran committed")

	paid := b.pg.Count(t, `SELECT count(*) FROM payments`)
	stop := make(chan struct{})
	rs = reqs("t", "x", "y", "z")
	pay = payEach(t, rs, make([]int64, 3), &ran)
	run, err = b.ledger.DoEach(ctx, rs, inbox.EachOptions{Stop: stop}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		close(stop)
		return pay(ctx, tx, i)
	})
	require.NoError(t, err)
	require.Len(t, run.Outcomes, 1)
	require.Equal(t, paid+1, b.pg.Count(t, `SELECT count(*) FROM payments`))
}

// With Redis, a run answers cached keys from Redis without a Postgres
// claim, turns away keys locked elsewhere, and caches what it committed,
// while holding each key's lock.
func TestDoEachRedisFastPath(t *testing.T) {
	t.Parallel()
	b := redisLedger(t, inbox.RedisConfig{})
	ctx := context.Background()
	var ran atomic.Int64
	rs := reqs("r", "a", "b", "c")
	run, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, payEach(t, rs, make([]int64, 3), &ran))
	require.NoError(t, err)
	require.Len(t, run.Outcomes, 3)
	client, _ := testsvc.Redis(t)
	for _, r := range rs {
		res, lock := b.ledger.RedisKeys(r.Key)
		n, err := client.Exists(ctx, res).Result()
		require.NoError(t, err)
		require.EqualValues(t, 1, n, "%s cached after the commit", r.ID)
		n, err = client.Exists(ctx, lock).Result()
		require.NoError(t, err)
		require.Zero(t, n, "%s's lock released", r.ID)
	}

	// Remove the rows behind the ledger's back: only Redis can answer now.
	b.pg.Exec(t, `DELETE FROM processed_events`)
	before := b.ledger.Counters()
	rs = reqs("r", "a", "b", "c", "d")
	run, err = b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, payEach(t, rs, make([]int64, 4), &ran))
	require.NoError(t, err)
	for i, id := range []string{"a", "b", "c"} {
		o := run.Outcomes[i]
		require.Equal(t, inbox.Duplicate, o.Disposition, id)
		require.True(t, o.Cached, id)
		require.Equal(t, []byte(id), o.Result.Body, id)
	}
	require.Equal(t, inbox.Executed, run.Outcomes[3].Disposition)
	require.EqualValues(t, 3, b.ledger.Counters().CacheHits-before.CacheHits)
	require.EqualValues(t, 4, ran.Load(), "no handler ran for the cached keys")
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events`), "no Postgres claim for the cached keys")

	// A key locked by another caller is InFlight, and the run ends there.
	_, lock := b.ledger.RedisKeys(req("r", "f").Key)
	require.NoError(t, client.Set(ctx, lock, "someone-else", time.Minute).Err())
	rs = reqs("r", "e", "f", "g")
	run, err = b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, payEach(t, rs, make([]int64, 3), &ran))
	require.NoError(t, err)
	require.Len(t, run.Outcomes, 2)
	require.Equal(t, inbox.Executed, run.Outcomes[0].Disposition)
	require.Equal(t, inbox.InFlight, run.Outcomes[1].Disposition)
	v, err := client.Get(ctx, lock).Result()
	require.NoError(t, err)
	require.Equal(t, "someone-else", v, "another caller's lock is left alone")
	res, glock := b.ledger.RedisKeys(req("r", "g").Key)
	n, err := client.Exists(ctx, res, glock).Result()
	require.NoError(t, err)
	require.Zero(t, n, "g, not reached, is neither cached nor left locked")

	// Release after a run: the cached entry goes, and the key runs again.
	_, err = b.ledger.Release(ctx, req("r", "e").Key)
	require.NoError(t, err)
	rs = reqs("r", "e")
	b.pg.Exec(t, `DELETE FROM payments WHERE id = 'e'`)
	run, err = b.ledger.DoEach(ctx, append(rs, req("r", "h")), inbox.EachOptions{}, payEach(t, append(rs, req("r", "h")), make([]int64, 2), &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, run.Outcomes[0].Disposition, "released: runs again, not answered from a stale cache")
}

// Copies of a key within one DoEach or DoBatch call answer as Do would
// once the first copy had run: the same fingerprint is a Duplicate,
// another is a Mismatch, and against a row that was there before, each
// copy is compared with that row.
func TestCopiesInABatchCompareFingerprints(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	withFP := func(id, fp string) inbox.Request {
		r := req("orders", id)
		r.Fingerprint = []byte(fp)
		return r
	}
	dispositions := func(outs []inbox.Outcome) []inbox.Disposition {
		var d []inbox.Disposition
		for _, o := range outs {
			d = append(d, o.Disposition)
		}
		return d
	}
	_, err := b.ledger.Do(ctx, withFP("old", "a"), noop)
	require.NoError(t, err)
	for _, call := range []struct {
		name string
		do   func(rs []inbox.Request) ([]inbox.Outcome, error)
	}{
		{"DoEach", func(rs []inbox.Request) ([]inbox.Outcome, error) {
			run, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, func(context.Context, pgx.Tx, int) (inbox.Result, error) {
				return inbox.Result{}, nil
			})
			return run.Outcomes, err
		}},
		{"DoBatch", func(rs []inbox.Request) ([]inbox.Outcome, error) {
			return b.ledger.DoBatch(ctx, rs, batchNoop)
		}},
	} {
		t.Run(call.name, func(t *testing.T) {
			id := "new-" + call.name
			outs, err := call.do([]inbox.Request{withFP(id, "a"), withFP(id, "b"), withFP(id, "a"),
				withFP("old", "b"), withFP("old", "a")})
			require.NoError(t, err)
			require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Mismatch, inbox.Duplicate,
				inbox.Mismatch, inbox.Duplicate}, dispositions(outs))
		})
	}
}
