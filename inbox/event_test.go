package inbox_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/inbox"
)

// A handler sees its event's key and a sequence that starts again on every
// run, so IDs derived from them are the same when the handler is retried.
func TestEventKeyAndSequenceRestartPerRun(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	_, ok := inbox.EventKey(ctx)
	require.False(t, ok)
	require.Equal(t, int64(-1), inbox.Sequence(ctx))

	r := req("events", "e-1")
	type run struct {
		key  inbox.Key
		seqs []int64
	}
	var runs []run
	handler := func(fail bool) inbox.TxFunc {
		return func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			k, ok := inbox.EventKey(ctx)
			require.True(t, ok)
			runs = append(runs, run{k, []int64{inbox.Sequence(ctx), inbox.Sequence(ctx), inbox.Sequence(ctx)}})
			if fail {
				return inbox.Result{}, errors.New("first run fails")
			}
			return inbox.Result{}, nil
		}
	}
	_, err := b.ledger.Do(ctx, r, handler(true))
	require.Error(t, err)
	out, err := b.ledger.Do(ctx, r, handler(false))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)

	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = b.ledger.DoTx(ctx, tx, req("events", "e-2"), handler(false))
	require.NoError(t, err)

	_, err = b.ledger.DoLeased(ctx, req("events", "e-3"), time.Minute, func(ctx context.Context, _ int64) (inbox.Result, error) {
		k, ok := inbox.EventKey(ctx)
		require.True(t, ok)
		runs = append(runs, run{k, []int64{inbox.Sequence(ctx)}})
		return inbox.Result{}, nil
	})
	require.NoError(t, err)

	require.Len(t, runs, 4)
	for i, want := range []string{"e-1", "e-1", "e-2", "e-3"} {
		require.Equal(t, want, runs[i].key.ID)
		require.Equal(t, "events", runs[i].key.Scope)
	}
	require.Equal(t, []int64{0, 1, 2}, runs[0].seqs)
	require.Equal(t, []int64{0, 1, 2}, runs[1].seqs, "a retried run numbers from 0 again")
	require.Equal(t, []int64{0}, runs[3].seqs)
}

// AtCommit queues a write into Do's commit round trip, only for the
// transaction Do gave the handler: not for a savepoint opened from it, not
// under DoTx, not outside a handler. A handler that fails takes its queued
// writes with it.
func TestAtCommit(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	const ins = `INSERT INTO payments (id, amount) VALUES ($1, 1)`
	require.False(t, inbox.AtCommit(ctx, nil, ins, "x"), "outside a handler")

	var seenInside int
	out, err := b.ledger.Do(ctx, req("events", "a-1"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		require.True(t, inbox.AtCommit(ctx, tx, ins, "queued"))
		sp, err := tx.Begin(ctx)
		require.NoError(t, err)
		require.False(t, inbox.AtCommit(ctx, sp, ins, "savepoint"), "a savepoint's rollback would not undo it")
		require.NoError(t, sp.Rollback(ctx))
		err = tx.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&seenInside)
		return inbox.Result{}, err
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Zero(t, seenInside, "the queued write is sent with the commit")
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'queued'`))

	_, err = b.ledger.Do(ctx, req("events", "a-2"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		require.True(t, inbox.AtCommit(ctx, tx, ins, "failed"))
		return inbox.Result{}, errors.New("handler fails after queueing")
	})
	require.Error(t, err)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'failed'`))

	// A queued write that fails fails the commit: nothing is recorded.
	_, err = b.ledger.Do(ctx, req("events", "a-3"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		require.True(t, inbox.AtCommit(ctx, tx, ins, "queued")) // a duplicate primary key
		return inbox.Result{}, nil
	})
	require.Error(t, err)
	_, err = b.ledger.Lookup(ctx, inbox.Key{Scope: "events", ID: "a-3"})
	require.ErrorIs(t, err, inbox.ErrNotFound, "not recorded")

	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = b.ledger.DoTx(ctx, tx, req("events", "a-4"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		require.False(t, inbox.AtCommit(ctx, tx, ins, "dotx"), "DoTx does not own the commit")
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
}
