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

// The ledger row of a transactional Do is written once, complete, with
// the commit: one tuple, its result and run time in it.
func TestDoWritesTheRowOnceComplete(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	out, err := b.ledger.Do(ctx, req("orders", "once"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		time.Sleep(2 * time.Millisecond)
		return pay("p-once", nil)(ctx, tx)
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Equal(t, 1, out.Record.Attempts)
	require.Equal(t, out.Record.CreatedAt.Add(24*time.Hour), out.Record.ExpiresAt)

	rec, err := b.ledger.Lookup(ctx, req("orders", "once").Key)
	require.NoError(t, err)
	require.Equal(t, 201, rec.Result.Code)
	require.Equal(t, `{"id":"p-once"}`, string(rec.Result.Body))
	require.GreaterOrEqual(t, rec.Duration, 2*time.Millisecond, "the run time is stored with the row")
	require.Equal(t, out.Record.ExpiresAt, rec.ExpiresAt)
	// One tuple version: the first row of a fresh table, inserted
	// complete and never updated (an update would have moved the live
	// version to (0,2)).
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE ctid = '(0,1)' AND event_id = 'once'`))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events`))
}

// A row for the key written while the handler runs by someone who does not
// take the key's lock (here a plain INSERT from another connection) makes
// the commit's write fail: the handler's transaction rolls back, the key
// is claimed again, and the caller gets that row as a Duplicate. The
// effect is never doubled.
func TestRowWrittenWithoutTheLockWinsAndTheEffectRollsBack(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	runs := 0
	out, err := b.ledger.Do(ctx, req("orders", "sneak"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		runs++
		if runs == 1 {
			_, err := b.pg.Pool.Exec(ctx, `INSERT INTO processed_events (scope, tenant, event_id, status, source, expires_at)
				VALUES ('orders', '', 'sneak', 'failed', 'other', now() + interval '1 hour')`)
			require.NoError(t, err)
		}
		return pay("p-sneak", nil)(ctx, tx)
	})
	require.NoError(t, err)
	require.Equal(t, 1, runs, "the second claim finds the row and does not run the handler")
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.Equal(t, inbox.StatusFailed, out.Record.Status)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM payments`), "the handler's effect rolled back")

	// The same for a batch.
	runs = 0
	outs, err := b.ledger.DoBatch(ctx, []inbox.Request{req("orders", "b1"), req("orders", "b2")},
		func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
			runs++
			if runs == 1 {
				_, err := b.pg.Pool.Exec(ctx, `INSERT INTO processed_events (scope, tenant, event_id, status, source, expires_at)
					VALUES ('orders', '', 'b2', 'done', 'other', now() + interval '1 hour')`)
				require.NoError(t, err)
			} else {
				require.Equal(t, []int{0}, fresh)
			}
			for _, i := range fresh {
				if _, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 1)`, []string{"b1", "b2"}[i]); err != nil {
					return nil, err
				}
			}
			return nil, nil
		})
	require.NoError(t, err)
	require.Equal(t, 2, runs)
	require.Equal(t, inbox.Executed, outs[0].Disposition)
	require.Equal(t, inbox.Duplicate, outs[1].Disposition)
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments`))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'b1'`))
}

// A handler that ends the ledger's transaction itself is refused: its
// COMMIT released the key's lock before the ledger row was written.
func TestHandlerEndingTheTransactionIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	for _, stmt := range []string{"COMMIT", "ROLLBACK"} {
		_, err := b.ledger.Do(ctx, req("orders", "end-"+stmt), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			_, err := tx.Exec(ctx, stmt)
			return inbox.Result{}, err
		})
		require.ErrorIs(t, err, inbox.ErrTxOwned, stmt)
		_, err = b.ledger.Lookup(ctx, req("orders", "end-"+stmt).Key)
		require.True(t, errors.Is(err, inbox.ErrNotFound), stmt)
	}
}

// An expired row that the janitor has not purged yet is taken over in
// place: the key runs again, once, and its row is renewed.
func TestWriteOnceTakesOverAnExpiredRow(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{})
	ctx := context.Background()
	b.pg.Exec(t, `INSERT INTO processed_events (scope, tenant, event_id, status, source, attempts, response_code, expires_at)
		VALUES ('orders', '', 'old', 'done', 'kafka', 3, 200, now() - interval '1 minute')`)
	var ran int
	for i := 0; i < 2; i++ {
		out, err := b.ledger.Do(ctx, req("orders", "old"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			ran++
			return pay("p-old", nil)(ctx, tx)
		})
		require.NoError(t, err)
		require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Duplicate}[i], out.Disposition)
	}
	require.Equal(t, 1, ran)
	rec, err := b.ledger.Lookup(ctx, req("orders", "old").Key)
	require.NoError(t, err)
	require.Equal(t, 1, rec.Attempts)
	require.Equal(t, 201, rec.Result.Code)
}
