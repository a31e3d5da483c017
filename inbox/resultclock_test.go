package inbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// clocked is a request whose result is kept for d while its key lives on.
func clocked(id string, d time.Duration) inbox.Request {
	r := req("clocks", id)
	r.Fingerprint = []byte("fp-" + id)
	r.ResultTTL = d
	return r
}

// TestLayoutsResultClock: a result past its own clock is no longer
// answered, on every read path, while its key still deduplicates (the
// handler does not run again) and a reuse with another request is still
// a Mismatch; the janitor clears the stored result and keeps the row.
func TestLayoutsResultClock(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b := setupLayout(t, mc, inbox.Config{})
		ctx := context.Background()
		var ran atomic.Int64
		const resultTTL = 700 * time.Millisecond

		// Do, DoBatch, DoTx and a lease each record a result with a clock.
		out, err := b.ledger.Do(ctx, clocked("do", resultTTL), pay("p-do", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
		outs, err := b.ledger.DoBatch(ctx, []inbox.Request{clocked("batch", resultTTL)},
			func(context.Context, pgx.Tx, []int) ([]inbox.Result, error) {
				ran.Add(1)
				return []inbox.Result{{Code: 202, Body: []byte("batch")}}, nil
			})
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, outs[0].Disposition)
		tx, err := b.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		out, err = b.ledger.DoTx(ctx, tx, clocked("tx", resultTTL), pay("p-tx", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
		require.NoError(t, tx.Commit(ctx))
		lease, _, err := b.ledger.AcquireLease(ctx, clocked("lease", resultTTL), time.Minute)
		require.NoError(t, err)
		require.NotNil(t, lease)
		ran.Add(1)
		require.NoError(t, lease.Complete(ctx, inbox.Result{Code: 201, Body: []byte("lease")}))
		// A row without a clock of its own keeps its result.
		out, err = b.ledger.Do(ctx, clocked("keeps", 0), pay("p-keeps", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)

		// Before the clock: replayed.
		out, err = b.ledger.Do(ctx, clocked("do", resultTTL), pay("p-do", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.Equal(t, 201, out.Result.Code)
		require.False(t, out.Record.ResultGone)

		// After it (the lease's result is the last one stored): every
		// read answers the row without its result.
		testsvc.Eventually(t, 10*time.Second, func() bool {
			out, err := b.ledger.Do(ctx, clocked("lease", resultTTL), pay("p-lease", &ran))
			require.NoError(t, err)
			require.Equal(t, inbox.Duplicate, out.Disposition)
			return out.Record.ResultGone
		}, "the result's clock passes")
		for _, id := range []string{"do", "batch", "tx", "lease"} {
			out, err := b.ledger.Do(ctx, clocked(id, resultTTL), pay("p-"+id, &ran))
			require.NoError(t, err)
			require.Equal(t, inbox.Duplicate, out.Disposition, id)
			require.True(t, out.Record.ResultGone, id)
			require.True(t, out.Result.IsZero(), id)
			require.True(t, out.Record.Result.IsZero(), id)

			rec, err := b.ledger.Lookup(ctx, inbox.Key{Scope: "clocks", ID: id})
			require.NoError(t, err)
			require.True(t, rec.ResultGone, id)
			require.True(t, rec.Result.IsZero(), id)

			// The fingerprint outlives the result.
			other := clocked(id, resultTTL)
			other.Fingerprint = []byte("another request")
			out, err = b.ledger.Do(ctx, other, pay("p-other", &ran))
			require.NoError(t, err)
			require.Equal(t, inbox.Mismatch, out.Disposition, id)
		}
		outs, err = b.ledger.DoBatch(ctx, []inbox.Request{clocked("do", resultTTL), clocked("keeps", 0)},
			func(context.Context, pgx.Tx, []int) ([]inbox.Result, error) {
				t.Fatal("no key is new")
				return nil, nil
			})
		require.NoError(t, err)
		require.True(t, outs[0].Record.ResultGone)
		require.True(t, outs[0].Result.IsZero())
		require.False(t, outs[1].Record.ResultGone)
		require.Equal(t, 201, outs[1].Result.Code)
		tx, err = b.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		out, err = b.ledger.DoTx(ctx, tx, clocked("do", resultTTL), pay("p-do", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.True(t, out.Record.ResultGone)
		require.NoError(t, tx.Rollback(ctx))
		require.EqualValues(t, 5, ran.Load(), "no handler ran again")

		// The results are still stored until the janitor clears them; it
		// keeps the rows, their fingerprints and their clocks.
		stored := func() int {
			return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'clocks'
				AND (response_body IS NOT NULL OR response_code IS NOT NULL OR response_headers IS NOT NULL)`)
		}
		require.Equal(t, 5, stored())
		_, err = b.ledger.Purge(ctx, inbox.JanitorConfig{BatchSize: 2})
		require.NoError(t, err)
		require.Equal(t, 1, stored(), "only the result without a clock of its own is left")
		require.Equal(t, 5, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'clocks'
			AND fingerprint IS NOT NULL AND expires_at > now()`))
		require.Equal(t, 4, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'clocks'
			AND result_expires_at <= now()`))
		for _, id := range []string{"do", "batch", "tx", "lease"} {
			out, err := b.ledger.Do(ctx, clocked(id, resultTTL), pay("p-"+id, &ran))
			require.NoError(t, err)
			require.Equal(t, inbox.Duplicate, out.Disposition, id)
			require.True(t, out.Record.ResultGone, id)
		}
		out, err = b.ledger.Do(ctx, clocked("keeps", 0), pay("p-keeps", &ran))
		require.NoError(t, err)
		require.Equal(t, 201, out.Result.Code)
		require.EqualValues(t, 5, ran.Load())

		// A result stored after a pass, whose clock passes later, is found
		// by the next pass (which starts a little before the last one).
		_, err = b.ledger.Do(ctx, clocked("later", 300*time.Millisecond), pay("p-later", &ran))
		require.NoError(t, err)
		testsvc.Eventually(t, 10*time.Second, func() bool {
			_, err := b.ledger.Purge(ctx, inbox.JanitorConfig{})
			require.NoError(t, err)
			return stored() == 1
		}, "the later result is cleared")
	})
}

// TestResultClockNotLongerThanTheKey: a ResultTTL not shorter than the
// row's TTL is no clock of its own; a negative one is refused.
func TestResultClockNotLongerThanTheKey(t *testing.T) {
	t.Parallel()
	b := setup(t, inbox.Config{ResultTTL: time.Hour})
	ctx := context.Background()
	r := req("clocks", "long")
	r.TTL = time.Minute
	_, err := b.ledger.Do(ctx, r, pay("p", nil))
	require.NoError(t, err)
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE result_expires_at IS NULL`))
	r = req("clocks", "short")
	r.ResultTTL = -time.Second
	_, err = b.ledger.Do(ctx, r, pay("p2", nil))
	var ke *inbox.KeyError
	require.ErrorAs(t, err, &ke)
	_, err = inbox.New(b.pg.Pool, inbox.Config{ResultTTL: -time.Second})
	require.ErrorIs(t, err, inbox.ErrConfig)
}

// TestRedisResultClock: the replay cache does not answer a result past its
// clock.
func TestRedisResultClock(t *testing.T) {
	t.Parallel()
	c, prefix := testsvc.Redis(t)
	b := redisLedger(t, inbox.RedisConfig{Client: c, Prefix: prefix})
	ctx := context.Background()
	var ran atomic.Int64
	r := clocked("cached", 500*time.Millisecond)
	_, err := b.ledger.Do(ctx, r, pay("p", &ran))
	require.NoError(t, err)
	out, err := b.ledger.Do(ctx, r, pay("p", &ran))
	require.NoError(t, err)
	require.Equal(t, 201, out.Result.Code)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		out, err := b.ledger.Do(ctx, r, pay("p", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		if !out.Record.ResultGone {
			require.Equal(t, 201, out.Result.Code)
		}
		return out.Record.ResultGone && !out.Cached
	}, "the result's clock passes")
	require.EqualValues(t, 1, ran.Load())
}
