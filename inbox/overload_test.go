package inbox_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// A call whose AcquireWait runs out while every connection of the pool is
// held is shed with ErrOverloaded before it claims its key: its handler
// does not run and nothing is recorded; once a connection is free, the
// same key runs, once.
func TestAcquireWaitShedsWhenThePoolIsFull(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{}, testsvc.MaxConns(1))
	ctx := context.Background()
	held, err := b.pg.Pool.Acquire(ctx) // the pool's only connection
	require.NoError(t, err)

	var ran atomic.Int64
	r := req("orders", "shed")
	r.AcquireWait = 50 * time.Millisecond
	start := time.Now()
	_, err = b.ledger.Do(ctx, r, pay("shed", &ran))
	require.ErrorIs(t, err, inbox.ErrOverloaded)
	var oe *inbox.OverloadError
	require.True(t, errors.As(err, &oe))
	require.Equal(t, 50*time.Millisecond, oe.Wait)
	require.EqualValues(t, 1, oe.Conns)
	require.True(t, inbox.IsTransient(err), "a retry can cure overload")
	require.GreaterOrEqual(t, time.Since(start), 50*time.Millisecond)
	require.Zero(t, ran.Load())

	lr := req("orders", "shed-lease")
	lr.AcquireWait = 20 * time.Millisecond
	lease, _, err := b.ledger.AcquireLease(ctx, lr, time.Minute)
	require.ErrorIs(t, err, inbox.ErrOverloaded)
	require.Nil(t, lease)
	require.EqualValues(t, 2, b.ledger.Counters().Overloaded)

	held.Release()
	out, err := b.ledger.Do(ctx, r, pay("shed", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	out, err = b.ledger.Do(ctx, r, pay("shed", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.EqualValues(t, 1, ran.Load())
	var n int
	require.NoError(t, b.pg.Pool.QueryRow(ctx, `SELECT count(*) FROM payments WHERE id = 'shed'`).Scan(&n))
	require.Equal(t, 1, n)
	require.EqualValues(t, 2, b.ledger.Counters().Overloaded)
}
