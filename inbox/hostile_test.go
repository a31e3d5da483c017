package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// swallow is the everyday hostile handler: it inserts a row that violates
// the primary key, ignores the error ("already there, fine") and returns
// success. The transaction is aborted by then.
func swallow(id string, res inbox.Result) inbox.TxFunc {
	return func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		_, _ = tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 1)`, id)
		_, _ = tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 1)`, id) // unique violation, ignored
		return res, nil
	}
}

func TestSwallowedSQLErrorIsNeverReportedDone(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		res  inbox.Result
	}{
		{"no result", inbox.Result{}},            // COMMIT alone
		{"with result", inbox.Result{Code: 201}}, // the result's write pipelined with COMMIT
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, inbox.Config{})
			ctx := context.Background()
			r := req("orders", "evt-swallow")

			out, err := b.ledger.Do(ctx, r, swallow("p1", tc.res))
			require.ErrorIs(t, err, inbox.ErrRolledBack)
			var rb *inbox.RolledBackError
			require.ErrorAs(t, err, &rb)
			require.False(t, inbox.IsTransient(err), "a handler's fault is not transient")
			require.NotEqual(t, inbox.Executed, out.Disposition)
			require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM payments`), "no effect")
			require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events`), "no ledger row")

			// The key is still new: a well-behaved retry runs.
			var ran atomic.Int64
			out, err = b.ledger.Do(ctx, r, pay("p1", &ran))
			require.NoError(t, err)
			require.Equal(t, inbox.Executed, out.Disposition)
			require.EqualValues(t, 1, ran.Load())
		})
	}
}

func TestSwallowedSQLErrorInBatchAndDoTx(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()

	reqs := []inbox.Request{req("orders", "b1"), req("orders", "b2")}
	outs, err := b.ledger.DoBatch(ctx, reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
		_, err := swallow("p1", inbox.Result{})(ctx, tx)
		return nil, err
	})
	require.ErrorIs(t, err, inbox.ErrRolledBack)
	require.Nil(t, outs)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events`))

	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = b.ledger.DoTx(ctx, tx, req("orders", "t1"), swallow("p2", inbox.Result{}))
	require.ErrorIs(t, err, inbox.ErrRolledBack)
	// pgx's own Commit reports the rollback too.
	require.Error(t, tx.Commit(ctx))
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events`))
}

func TestDeferredConstraintFailingAtCommitIsAHandlerFault(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	b.pg.Exec(t, `CREATE TABLE refs (id int PRIMARY KEY, parent text REFERENCES payments (id) DEFERRABLE INITIALLY DEFERRED)`)
	ctx := context.Background()
	var ran atomic.Int64
	out, err := b.ledger.Do(ctx, req("orders", "evt-deferred"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		ran.Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO refs VALUES (1, 'no-such-payment')`) // checked at COMMIT
		return inbox.Result{}, err
	})
	require.EqualValues(t, 1, ran.Load())
	require.ErrorIs(t, err, inbox.ErrStore)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "23503", pgErr.Code)
	require.False(t, inbox.IsTransient(err), "a constraint failing at COMMIT must not be retried forever uncounted")
	require.NotEqual(t, inbox.Executed, out.Disposition)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events`))
}

// TestCommitUnknown cuts the connection after the server committed and
// before the client heard of it: the ledger must say the outcome is
// unknown (not done, not failed), and a retry must find it done.
func TestCommitUnknown(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	proxy := testsvc.Proxy(t, b.pg.Host())
	pool := b.pg.PoolVia(t, proxy.Addr(), 2)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	r := req("orders", "evt-unknown")

	var ran atomic.Int64
	// CommandComplete for COMMIT: 'C', length, "COMMIT\x00".
	fired := proxy.CutWhenServerSends([]byte("COMMIT\x00"))
	out, err := l.Do(ctx, r, pay("p1", &ran))
	select {
	case <-fired:
	default:
		t.Fatalf("the fault did not fire: COMMIT's answer was never seen (out %v, err %v)", out.Disposition, err)
	}
	require.ErrorIs(t, err, inbox.ErrCommitUnknown)
	require.ErrorIs(t, err, inbox.ErrStore)
	require.True(t, inbox.IsTransient(err), "retrying an unknown commit is safe")
	require.NotEqual(t, inbox.Executed, out.Disposition)
	require.Equal(t, "justonce/inbox: commit: outcome unknown: "+errors.Unwrap(errors.Unwrap(err)).Error(), err.Error(),
		"the error text names the step once, without repeated prefixes")

	// It did commit: the retry is a duplicate and the handler does not run.
	out, err = l.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.EqualValues(t, 1, ran.Load())
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments`))
}

func TestCancelledWaitIsReportedAsCancelled(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	r := req("orders", "evt-held")
	r.LockWait = time.Minute
	holding, release := make(chan struct{}), make(chan struct{})
	go func() {
		_, _ = b.ledger.Do(context.Background(), r, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			close(holding)
			<-release
			return inbox.Result{}, nil
		})
	}()
	<-holding
	defer close(release)

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	out, err := b.ledger.Do(ctx, r, pay("p1", nil))
	require.ErrorIs(t, err, context.DeadlineExceeded, "a caller that gave up is told so, not InFlight with nil")
	require.NotEqual(t, inbox.InFlight, out.Disposition)
}

// TestDoTxDuplicateHoldsNoLock: a caller whose transaction got Duplicate
// from DoTx and stays open must not make other callers of that key answer
// InFlight.
func TestDoTxDuplicateHoldsNoLock(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	r := req("orders", "evt-done")
	_, err := b.ledger.Do(ctx, r, pay("p1", nil))
	require.NoError(t, err)

	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	out, err := b.ledger.DoTx(ctx, tx, r, pay("p1", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)

	// tx is still open; another caller is answered Duplicate, not InFlight.
	out, err = b.ledger.Do(ctx, r, pay("p1", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)

	// And tx is still usable.
	var one int
	require.NoError(t, tx.QueryRow(ctx, `SELECT 1`).Scan(&one))

	// A claimed key stays locked for the claimer's transaction.
	r2 := req("orders", "evt-new")
	out, err = b.ledger.DoTx(ctx, tx, r2, pay("p2", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	out, err = b.ledger.Do(ctx, r2, pay("p2", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.InFlight, out.Disposition)
	require.NoError(t, tx.Commit(ctx))
	out, err = b.ledger.Do(ctx, r2, pay("p2", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
}

// TestLeaseCompletionBlipDoesNotRunTheEffectTwice: the connection is lost
// while the completion is written; DoLeased retries it, so the key ends
// done and the effect does not run again after the lease lapses.
func TestLeaseCompletionBlipDoesNotRunTheEffectTwice(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	proxy := testsvc.Proxy(t, b.pg.Host())
	pool := b.pg.PoolVia(t, proxy.Addr(), 4)
	var logs testsvc.LogBuffer
	l, err := inbox.New(pool, inbox.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	require.NoError(t, err)
	ctx := context.Background()
	r := req("payments", "charge-blip")
	lease := 300 * time.Millisecond

	var ran atomic.Int64
	out, err := l.DoLeased(ctx, r, lease, func(ctx context.Context, token int64) (inbox.Result, error) {
		ran.Add(1)
		// The effect happened; now the network drops every connection and
		// refuses new ones for a moment, while the completion is written.
		proxy.Refuse(true)
		proxy.CutAll()
		time.AfterFunc(2*lease/3, func() { proxy.Refuse(false) })
		return inbox.Result{Code: 200}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Contains(t, logs.String(), "recording a lease-mode result failed", "the blip hit the completion")

	time.Sleep(2 * lease) // past the lease: a lapsed lease would be taken over now
	out, err = l.DoLeased(ctx, r, lease, func(context.Context, int64) (inbox.Result, error) {
		ran.Add(1)
		return inbox.Result{Code: 200}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.EqualValues(t, 1, ran.Load(), "the external effect ran once")
}

func TestIsTransientClassifiesByCause(t *testing.T) {
	t.Parallel()
	pg := func(code string) error { return &pgconn.PgError{Code: code} }
	store := func(op string, err error) error { return &inbox.StoreError{Op: op, Err: err} }
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{pg("08006"), true},
		{pg("57P01"), true},
		{pg("53300"), true},
		{pg("53100"), true},
		{pg("58030"), true},
		{pg("25006"), true},
		{pg("55P03"), true},
		{pg("57014"), false}, // a statement timeout: maybe the event's own
		{pg("40001"), true},
		{pg("40P01"), true},
		{fmt.Errorf("handler: %w", pg("40001")), true},
		{pg("23505"), false},
		{pg("22P02"), false},
		{pg("25P02"), false},
		{store("commit", pg("23503")), false},
		{store("commit", pg("08006")), true},
		{store("claim", &net.OpError{Op: "dial", Err: errors.New("connection refused")}), true},
		{store("commit", io.ErrUnexpectedEOF), true},
		{&inbox.RolledBackError{Op: "commit"}, false},
		{context.Canceled, false},
		{store("acquire", context.DeadlineExceeded), false},
		{&net.OpError{Op: "dial", Err: errors.New("refused")}, false}, // the handler's own HTTP call
		{errors.New("boom"), false},
	} {
		require.Equal(t, tc.want, inbox.IsTransient(tc.err), "%v", tc.err)
	}
}

// TestLeaseCompletionAnswerLost: the completion commits but its answer is
// cut; the retry finds the key done under its own token and reports
// Executed, not a lost lease.
func TestLeaseCompletionAnswerLost(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	proxy := testsvc.Proxy(t, b.pg.Host())
	pool := b.pg.PoolVia(t, proxy.Addr(), 4)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	r := req("payments", "charge-lost-answer")

	var ran atomic.Int64
	var fired <-chan struct{}
	out, err := l.DoLeased(ctx, r, 30*time.Second, func(ctx context.Context, token int64) (inbox.Result, error) {
		ran.Add(1)
		fired = proxy.CutWhenServerSends([]byte("UPDATE 1\x00")) // the completion's answer
		return inbox.Result{Code: 201}, nil
	})
	select {
	case <-fired:
	default:
		t.Fatal("the fault did not fire")
	}
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	rec, err := l.Lookup(ctx, r.Key)
	require.NoError(t, err)
	require.Equal(t, inbox.StatusDone, rec.Status)
	require.Equal(t, 201, rec.Result.Code)
	require.EqualValues(t, 1, ran.Load())
}
