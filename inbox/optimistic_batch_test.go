package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
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

// The tests below try to break DoEach's optimistic path (every key of a
// run claimed up front, no savepoint per request, the rows written with
// the commit): hostile handlers in the middle of a run, handlers that
// change their mind between runs, keys held or written elsewhere, crashes,
// and two ledgers deciding the same keys at once. Each counts the effects
// in a table without a unique constraint, so that a doubled one shows.

// eachCounter is an EachFunc with one effect per request in effects, which
// counts its calls per request and can be told to misbehave.
type eachCounter struct {
	rs    []inbox.Request
	mu    sync.Mutex
	calls map[string]int
	// hostile, when it returns a non-nil function for the call'th call
	// (from 1) of request i's handler, runs that instead of the effect.
	hostile func(i, call int) func(ctx context.Context, tx pgx.Tx) (inbox.Result, error)
}

func newCounter(rs []inbox.Request) *eachCounter {
	return &eachCounter{rs: rs, calls: map[string]int{}}
}

func (c *eachCounter) fn(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
	c.mu.Lock()
	c.calls[c.rs[i].ID]++
	call := c.calls[c.rs[i].ID]
	c.mu.Unlock()
	if c.hostile != nil {
		if h := c.hostile(i, call); h != nil {
			return h(ctx, tx)
		}
	}
	// Two outputs named by the event and Sequence: the same on every run.
	for range 2 {
		if _, err := tx.Exec(ctx, `INSERT INTO effects (id, seq, run) VALUES ($1, $2, $3)`,
			c.rs[i].ID, inbox.Sequence(ctx), call); err != nil {
			return inbox.Result{}, err
		}
	}
	return inbox.Result{Code: 200, Body: []byte(fmt.Sprintf("%s:%d", c.rs[i].ID, call))}, nil
}

func (c *eachCounter) callsOf(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[id]
}

func setupEffects(t *testing.T, opts ...testsvc.PGOption) *bundle {
	t.Helper()
	b := setup(t, inbox.Config{}, opts...)
	b.pg.Exec(t, `CREATE TABLE effects (id text NOT NULL, seq bigint NOT NULL, run int NOT NULL)`)
	return b
}

// requireOnce checks that each of ids has its two effects and its ledger
// row once, and that nothing else has.
func requireOnce(t *testing.T, b *bundle, ids ...string) {
	t.Helper()
	for _, id := range ids {
		require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM effects WHERE id = $1`, id), "effects of %s", id)
		require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM effects WHERE id = $1 AND seq = 0`, id), "%s's outputs are numbered from 0", id)
		require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = $1`, id), "row of %s", id)
	}
	require.Equal(t, 2*len(ids), b.pg.Count(t, `SELECT count(*) FROM effects`), "no other effect")
	require.Equal(t, len(ids), b.pg.Count(t, `SELECT count(*) FROM processed_events`), "no other row")
}

func dispositions(outs []inbox.Outcome) []inbox.Disposition {
	var d []inbox.Disposition
	for _, o := range outs {
		d = append(d, o.Disposition)
	}
	return d
}

// A hostile handler in the middle of a run: the requests before it commit
// once (their first run rolled back with the failure), it is rolled back
// alone and not run a second time, the ones after it do not start, and the
// ledger's one connection comes back clean (the pool has one: a connection
// left in a transaction would fail the next call). What savepoints cannot
// contain either fails the whole run, recording nothing.
func TestOptimisticRunHostileHandlerInTheMiddle(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	write := func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (id, seq, run) VALUES ('bad', 0, 0)`)
		return err
	}
	for _, tc := range []struct {
		name string
		bad  func(ctx context.Context, tx pgx.Tx) (inbox.Result, error)
		// failed checks the request's failure; whole, the run's.
		failed, whole func(t *testing.T, err error)
		panics        bool
	}{
		{name: "error after a write", bad: func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			if err := write(ctx, tx); err != nil {
				return inbox.Result{}, err
			}
			return inbox.Result{}, errors.New("boom")
		}, failed: func(t *testing.T, err error) { require.EqualError(t, err, "boom") }},
		{name: "swallowed SQL error with a result", bad: func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			_ = write(ctx, tx)
			_, _ = tx.Exec(ctx, `INSERT INTO no_such_table VALUES (1)`) // ignored
			return inbox.Result{Code: 200}, nil
		}, failed: func(t *testing.T, err error) { require.ErrorIs(t, err, inbox.ErrRolledBack) }},
		{name: "swallowed error inside its own savepoint, rolled back", bad: func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			// Handled properly: this one succeeds.
			sp, err := tx.Begin(ctx)
			if err != nil {
				return inbox.Result{}, err
			}
			_, _ = sp.Exec(ctx, `INSERT INTO no_such_table VALUES (1)`)
			if err := sp.Rollback(ctx); err != nil {
				return inbox.Result{}, err
			}
			return inbox.Result{}, errors.New("then fails")
		}, failed: func(t *testing.T, err error) { require.EqualError(t, err, "then fails") }},
		{name: "COMMIT sent through the transaction", bad: func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			_ = write(ctx, tx)
			_, err := tx.Exec(ctx, `commit`)
			return inbox.Result{}, err
		}, failed: func(t *testing.T, err error) { require.ErrorIs(t, err, inbox.ErrTxOwned) }},
		{name: "COMMIT sent through a savepoint of it", bad: func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return inbox.Result{}, err
			}
			_ = write(ctx, sp)
			b := &pgx.Batch{}
			b.Queue(`SELECT 1`)
			b.Queue(`/* done */ END`)
			return inbox.Result{}, sp.SendBatch(ctx, b).Close()
		}, failed: func(t *testing.T, err error) { require.ErrorIs(t, err, inbox.ErrTxOwned) }},
		{name: "panic after a write", bad: func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			_ = write(ctx, tx)
			panic("handler bug")
		}, panics: true},
		{name: "deferred constraint", bad: func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			_, err := tx.Exec(ctx, `INSERT INTO child VALUES ('none')`) // checked at COMMIT
			return inbox.Result{}, err
		}, whole: func(t *testing.T, err error) {
			require.ErrorIs(t, err, inbox.ErrStore)
			require.False(t, inbox.IsTransient(err), "the handlers' fault")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setupEffects(t, testsvc.MaxConns(1))
			b.pg.Exec(t, `CREATE TABLE parent (id text PRIMARY KEY)`)
			b.pg.Exec(t, `CREATE TABLE child (parent text REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)`)
			rs := reqs("orders", "a", "b", "bad", "c")
			c := newCounter(rs)
			c.hostile = func(i, _ int) func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				if i == 2 {
					return tc.bad
				}
				return nil
			}
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			var run inbox.EachRun
			var err error
			do := func() { run, err = b.ledger.DoEach(cctx, rs, inbox.EachOptions{}, c.fn) }
			switch {
			case tc.panics:
				require.PanicsWithValue(t, "handler bug", do)
				requireOnce(t, b)
			case tc.whole != nil:
				do()
				tc.whole(t, err)
				requireOnce(t, b)
			default:
				do()
				require.NoError(t, err)
				require.Len(t, run.Outcomes, 3, "the run ended at the hostile handler")
				require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Executed, 0}, dispositions(run.Outcomes))
				tc.failed(t, run.Failed)
				require.Equal(t, 1, c.callsOf("bad"), "one failure, one call")
				require.Zero(t, c.callsOf("c"), "c did not start")
				require.Equal(t, 2, c.callsOf("a"), "a's first run went with the failure")
				require.Equal(t, []byte("a:2"), run.Outcomes[0].Result.Body, "the result of the run that committed")
				requireOnce(t, b, "a", "b")
				rec, err := b.ledger.Lookup(ctx, rs[0].Key)
				require.NoError(t, err)
				require.Equal(t, []byte("a:2"), rec.Result.Body, "the result recorded is the committed run's")
			}
			// The one connection is clean, and the rest runs, once.
			c.hostile = nil
			run, err = b.ledger.DoEach(cctx, rs, inbox.EachOptions{}, c.fn)
			require.NoError(t, err)
			require.NoError(t, run.Failed)
			require.Len(t, run.Outcomes, 4)
			requireOnce(t, b, "a", "b", "bad", "c")
		})
	}
}

// The failing handler is the run's first: nothing runs again.
func TestOptimisticRunFirstHandlerFails(t *testing.T) {
	t.Parallel()
	b := setupEffects(t)
	rs := reqs("orders", "a", "b")
	c := newCounter(rs)
	c.hostile = func(i, _ int) func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		if i == 0 {
			return func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, errors.New("first") }
		}
		return nil
	}
	run, err := b.ledger.DoEach(context.Background(), rs, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	require.Len(t, run.Outcomes, 1)
	require.EqualError(t, run.Failed, "first")
	require.Equal(t, 1, c.callsOf("a"))
	require.Zero(t, c.callsOf("b"))
	requireOnce(t, b)
}

// Handlers that change their mind between the optimistic run and the run
// on savepoints: what the savepoints decide is what counts. b succeeds
// first, then fails; c fails first. The run ends at b, with b's second
// error; c is not decided (its failure went with the first run), and its
// handler ran once.
func TestOptimisticRunHandlerFailingOnlyWhenRunAgain(t *testing.T) {
	t.Parallel()
	b := setupEffects(t)
	rs := reqs("orders", "a", "b", "c", "d")
	c := newCounter(rs)
	c.hostile = func(i, call int) func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		switch {
		case i == 1 && call == 2:
			return func(context.Context, pgx.Tx) (inbox.Result, error) {
				return inbox.Result{}, errors.New("b, second run")
			}
		case i == 2 && call == 1:
			return func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, errors.New("c, first run") }
		}
		return nil
	}
	run, err := b.ledger.DoEach(context.Background(), rs, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	require.Equal(t, []inbox.Disposition{inbox.Executed, 0}, dispositions(run.Outcomes))
	require.EqualError(t, run.Failed, "b, second run")
	require.Equal(t, map[string]int{"a": 2, "b": 2, "c": 1}, c.calls)
	requireOnce(t, b, "a")
}

// A key held elsewhere (another caller's claim in flight) sends the run to
// savepoints before any handler runs: the keys before it run once and
// commit, the run ends InFlight at it, and the keys after it are neither
// run nor held.
func TestOptimisticRunKeyHeldElsewhere(t *testing.T) {
	t.Parallel()
	b := setupEffects(t)
	ctx := context.Background()
	rs := reqs("orders", "a", "b", "c")
	c := newCounter(rs)
	holding, release, done := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	releaseOnce := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseOnce) // before the pool closes, should the test fail
	go func() {
		_, err := b.ledger.Do(ctx, rs[1], func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			close(holding)
			<-release
			return c.fn(ctx, tx, 1)
		})
		done <- err
	}()
	<-holding
	run, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.InFlight}, dispositions(run.Outcomes))
	require.Equal(t, map[string]int{"a": 1}, c.calls, "a ran once; b is the other caller's, c did not start")
	// c is free: the run did not keep its lock.
	out, err := b.ledger.Do(ctx, rs[2], func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) { return c.fn(ctx, tx, 2) })
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	releaseOnce()
	require.NoError(t, <-done)
	require.Equal(t, map[string]int{"a": 1, "b": 1, "c": 1}, c.calls)
	run, err = b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	require.Equal(t, []inbox.Disposition{inbox.Duplicate, inbox.Duplicate, inbox.Duplicate}, dispositions(run.Outcomes))
	requireOnce(t, b, "a", "b", "c")
}

// A row written for a key of the run by someone who did not hold its lock
// (an operator's INSERT), while the run's handlers go on: the commit's
// INSERT meets it and rolls back; the run is made again on savepoints,
// which answer that key Duplicate. Its handler's effect is not recorded.
func TestOptimisticRunMeetsARowWrittenWithoutTheLock(t *testing.T) {
	t.Parallel()
	b := setupEffects(t)
	ctx := context.Background()
	rs := reqs("orders", "a", "b", "c")
	c := newCounter(rs)
	c.hostile = func(i, call int) func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		if i == 0 && call == 1 {
			// Another connection writes c's row, and commits.
			b.pg.Exec(t, `INSERT INTO processed_events (scope, tenant, event_id, status, source, response_code, expires_at)
				VALUES ('orders', '', 'c', 'done', 'kafka', 299, now() + interval '1 hour')`)
		}
		return nil
	}
	run, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	require.NoError(t, run.Failed)
	require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Executed, inbox.Duplicate}, dispositions(run.Outcomes))
	require.Equal(t, 299, run.Outcomes[2].Result.Code, "the row found")
	require.Equal(t, map[string]int{"a": 2, "b": 2, "c": 1}, c.calls)
	require.Equal(t, 4, b.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM effects WHERE id = 'c'`), "c's handler's effect went with the commit that failed")
	require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM processed_events`))
}

// An expired row is taken over on savepoints: each handler runs once.
func TestOptimisticRunTakesOverOnSavepoints(t *testing.T) {
	t.Parallel()
	b := setupEffects(t)
	b.pg.Exec(t, `INSERT INTO processed_events (scope, tenant, event_id, status, source, expires_at)
		VALUES ('orders', '', 'b', 'done', 'kafka', now() - interval '1 minute')`)
	rs := reqs("orders", "a", "b", "c")
	c := newCounter(rs)
	run, err := b.ledger.DoEach(context.Background(), rs, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Executed, inbox.Executed}, dispositions(run.Outcomes))
	require.Equal(t, map[string]int{"a": 1, "b": 1, "c": 1}, c.calls)
	requireOnce(t, b, "a", "b", "c")
}

// Duplicates, copies and new keys in one run: the duplicates are answered
// from the claim's look-up with their stored results, without a handler.
func TestOptimisticRunAnswersDuplicatesFromTheLookup(t *testing.T) {
	t.Parallel()
	b := setupEffects(t)
	ctx := context.Background()
	first := reqs("orders", "a", "b")
	c := newCounter(first)
	_, err := b.ledger.DoEach(ctx, first, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	rs := reqs("orders", "x", "a", "x", "b", "y")
	c2 := newCounter(rs)
	run, err := b.ledger.DoEach(ctx, rs, inbox.EachOptions{}, c2.fn)
	require.NoError(t, err)
	require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Duplicate, inbox.Duplicate, inbox.Duplicate, inbox.Executed},
		dispositions(run.Outcomes))
	require.Equal(t, []byte("a:1"), run.Outcomes[1].Result.Body)
	require.Equal(t, []byte("x:1"), run.Outcomes[2].Result.Body, "the copy answers with its first's result")
	require.Same(t, run.Outcomes[0].Record, run.Outcomes[2].Record)
	require.Equal(t, map[string]int{"x": 1, "y": 1}, c2.calls)
	rec := run.Outcomes[0].Record
	require.Equal(t, inbox.StatusDone, rec.Status)
	require.Equal(t, 1, rec.Attempts)
	require.True(t, rec.ExpiresAt.After(rec.CreatedAt.Add(23*time.Hour)))
	stored, err := b.ledger.Lookup(ctx, rs[0].Key)
	require.NoError(t, err)
	require.True(t, rec.CreatedAt.Equal(stored.CreatedAt), "%v, stored %v", rec.CreatedAt, stored.CreatedAt)
	require.Equal(t, []byte("x:1"), stored.Result.Body)
	require.Positive(t, stored.Duration, "each row carries its handler's run time")
	requireOnce(t, b, "a", "b", "x", "y")
}

// Crashes: the connection cut while a handler runs (nothing is recorded,
// and the run made again runs every handler once), and the connection cut
// after the server committed, before the client heard (ErrCommitUnknown:
// the run made again answers every key Duplicate, no handler runs).
func TestOptimisticRunCrash(t *testing.T) {
	t.Parallel()
	b := setupEffects(t)
	proxy := testsvc.Proxy(t, b.pg.Host())
	pool := b.pg.PoolVia(t, proxy.Addr(), 2)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	ctx := context.Background()

	rs := reqs("orders", "a", "b", "c")
	c := newCounter(rs)
	c.hostile = func(i, call int) func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		if i == 1 && call == 1 {
			return func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				var s string
				err := tx.QueryRow(ctx, `SELECT 'cut-' || 'here-b'`).Scan(&s)
				return inbox.Result{}, err
			}
		}
		return nil
	}
	fired := proxy.CutWhenServerSends([]byte("cut-here-b"))
	_, err = l.DoEach(ctx, rs, inbox.EachOptions{}, c.fn)
	<-fired
	require.ErrorIs(t, err, inbox.ErrStore)
	require.True(t, inbox.IsTransient(err), "a lost connection is retried")
	requireOnce(t, b)
	run, err := l.DoEach(ctx, rs, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	require.NoError(t, run.Failed)
	require.Equal(t, map[string]int{"a": 2, "b": 2, "c": 1}, c.calls)
	requireOnce(t, b, "a", "b", "c")

	rs = reqs("orders", "d", "e", "a")
	c = newCounter(rs)
	fired = proxy.CutWhenServerSends([]byte("COMMIT\x00"))
	_, err = l.DoEach(ctx, rs, inbox.EachOptions{}, c.fn)
	<-fired
	require.ErrorIs(t, err, inbox.ErrCommitUnknown)
	run, err = l.DoEach(ctx, rs, inbox.EachOptions{}, c.fn)
	require.NoError(t, err)
	require.Equal(t, []inbox.Disposition{inbox.Duplicate, inbox.Duplicate, inbox.Duplicate}, dispositions(run.Outcomes))
	require.Equal(t, map[string]int{"d": 1, "e": 1}, c.calls, "it had committed: nothing ran again")
	requireOnce(t, b, "a", "b", "c", "d", "e")
}

// Two ledgers (two processes' pools) decide overlapping runs of the same
// keys at once, in different orders, with handlers that sometimes fail
// once: every key has its effect once, and is Executed once across both.
func TestOptimisticRunsConcurrentDuplicatesAcrossLedgers(t *testing.T) {
	t.Parallel()
	b := setupEffects(t, testsvc.MaxConns(4))
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(b.pg.URL)
	require.NoError(t, err)
	cfg.MaxConns = 4
	pool2, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool2.Close)
	other, err := inbox.New(pool2, inbox.Config{})
	require.NoError(t, err)
	ledgers := []*inbox.Ledger{b.ledger, other}

	const n = 120
	var ids []string
	for i := range n {
		ids = append(ids, fmt.Sprintf("k%03d", i))
	}
	var executed [n]atomic.Int64
	var failedOnce sync.Map
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := ledgers[w%2]
			rnd := rand.New(rand.NewPCG(uint64(w), 7))
			// Each worker decides every key, in its own order, in runs of
			// up to 12 that it cuts where a run ended.
			order := rnd.Perm(n)
			if w >= 2 {
				order = make([]int, n)
				for i := range order {
					order[i] = (i + w*31) % n
				}
			}
			for len(order) > 0 {
				size := min(len(order), 1+rnd.IntN(12))
				batch := order[:size]
				rs := make([]inbox.Request, size)
				for j, k := range batch {
					rs[j] = req("orders", ids[k])
				}
				run, err := l.DoEach(ctx, rs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
					id := rs[i].ID
					if strings.HasSuffix(id, "7") {
						if _, loaded := failedOnce.LoadOrStore(id, true); !loaded {
							return inbox.Result{}, errors.New("fails once")
						}
					}
					time.Sleep(time.Duration(rnd.IntN(500)) * time.Microsecond)
					_, err := tx.Exec(ctx, `INSERT INTO effects (id, seq, run) VALUES ($1, $2, 0), ($1, $3, 0)`,
						id, inbox.Sequence(ctx), inbox.Sequence(ctx))
					return inbox.Result{}, err
				})
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				decided := 0
				for j, out := range run.Outcomes {
					if (run.Failed != nil && j == len(run.Outcomes)-1) || out.Disposition == inbox.InFlight {
						break
					}
					if out.Disposition == inbox.Executed {
						executed[batch[j]].Add(1)
					}
					decided++
				}
				if decided == 0 {
					time.Sleep(time.Millisecond) // held elsewhere, or failed: come back
				}
				order = order[decided:]
			}
		}()
	}
	wg.Wait()
	for k, id := range ids {
		require.EqualValues(t, 1, executed[k].Load(), "%s executed once across both ledgers", id)
	}
	requireOnce(t, b, ids...)
}
