package inbox_test

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// pauser stops a hook for one key until the test lets it go on.
type pauser struct {
	key     inbox.Key
	armed   atomic.Bool
	reached chan struct{}
	resume  chan struct{}
}

func newPauser(k inbox.Key) *pauser {
	return &pauser{key: k, reached: make(chan struct{}), resume: make(chan struct{})}
}

func (p *pauser) hook(k inbox.Key) {
	if k != p.key || !p.armed.CompareAndSwap(true, false) {
		return
	}
	close(p.reached)
	<-p.resume
}

func waitClosed(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// TestReleaseRacesFastPathCacheWrite interleaves a fast-path call that has
// read the old row in Postgres, and is about to cache it, with Release, in
// both orders of the call's cache write and Release's invalidation. After
// Release returned, the cache does not hold the old result and the next
// call runs the handler.
func TestReleaseRacesFastPathCacheWrite(t *testing.T) {
	t.Parallel()
	c, prefix := testsvc.Redis(t)
	b := redisLedger(t, inbox.RedisConfig{Client: c, Prefix: prefix})
	ctx := context.Background()

	for _, order := range []string{"write after invalidation", "write before invalidation"} {
		t.Run(order, func(t *testing.T) {
			r := req("orders", "race-"+order)
			resKey, lockKey := b.ledger.RedisKeys(r.Key)
			var ran atomic.Int64
			out, err := b.ledger.Do(ctx, r, pay(r.ID+"-1", &ran))
			require.NoError(t, err)
			require.Equal(t, inbox.Executed, out.Disposition)
			// Drop the cached entry, so that the next call reads the row in
			// Postgres and caches what it read.
			require.NoError(t, c.Del(ctx, resKey).Err())

			call := newPauser(r.Key)   // the call, after Postgres answered
			change := newPauser(r.Key) // Release, after the row is deleted
			b.ledger.SetRedisHooks(call.hook, change.hook)
			t.Cleanup(func() { b.ledger.SetRedisHooks(nil, nil) })
			call.armed.Store(true)

			type result struct {
				out inbox.Outcome
				err error
			}
			callDone := make(chan result, 1)
			go func() {
				out, err := b.ledger.Do(ctx, r, pay("never", &ran))
				callDone <- result{out, err}
			}()
			waitClosed(t, call.reached, "the call to read the old row")
			// The call holds the Redis lock and has the old row in hand.
			require.EqualValues(t, 1, c.Exists(ctx, lockKey).Val())

			releaseDone := make(chan error, 1)
			if order == "write after invalidation" {
				ok, err := b.ledger.Release(ctx, r.Key)
				require.NoError(t, err)
				require.True(t, ok)
				close(call.resume)
			} else {
				change.armed.Store(true)
				go func() {
					ok, err := b.ledger.Release(ctx, r.Key)
					if err == nil && !ok {
						err = errors.New("release found no row")
					}
					releaseDone <- err
				}()
				waitClosed(t, change.reached, "Release to delete the row")
				close(call.resume)
				res := <-callDone
				callDone <- res
				// The call wrote the old result before the invalidation...
				require.EqualValues(t, 1, c.Exists(ctx, resKey).Val())
				close(change.resume)
				// ...which Release then deletes.
				require.NoError(t, <-releaseDone)
			}
			res := <-callDone
			require.NoError(t, res.err)
			require.Equal(t, inbox.Duplicate, res.out.Disposition, "the call ran with Release and read the old row")

			require.Zero(t, c.Exists(ctx, resKey).Val(), "no stale result cached after Release returned")
			out, err = b.ledger.Do(ctx, r, pay(r.ID+"-2", &ran))
			require.NoError(t, err)
			require.Equal(t, inbox.Executed, out.Disposition, "the released key runs again")
			require.EqualValues(t, 2, ran.Load())
		})
	}
}

// TestReleaseWithRedisDown: a Redis that does not answer before Release
// touches the row fails the release with nothing changed; one that fails
// after the row was deleted makes Release report the row released with
// ErrCacheStale, never a nil error. RecordFailure reports it the same way.
func TestReleaseWithRedisDown(t *testing.T) {
	t.Parallel()
	rp := testsvc.StartRedis(t)
	client := testsvc.NewRedisClient(rp.Addr)
	t.Cleanup(func() { _ = client.Close() })
	b := setup(t, inbox.Config{Redis: &inbox.RedisConfig{Client: client, Timeout: 500 * time.Millisecond}}, testsvc.MaxConns(4))
	ctx := context.Background()
	count := func(id string) int {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = $1`, id)
	}

	r := req("orders", "down-before")
	_, err := b.ledger.Do(ctx, r, pay("p1", nil))
	require.NoError(t, err)
	out, err := b.ledger.Do(ctx, r, pay("p1", nil))
	require.NoError(t, err)
	require.True(t, out.Cached)

	// Down before the release: nothing changes.
	rp.Stop(t)
	ok, err := b.ledger.Release(ctx, r.Key)
	require.ErrorIs(t, err, inbox.ErrCacheUnavailable)
	require.NotErrorIs(t, err, inbox.ErrCacheStale)
	var ce *inbox.CacheError
	require.ErrorAs(t, err, &ce)
	require.False(t, ce.Stale)
	require.False(t, ok)
	require.Equal(t, 1, count(r.ID), "the row is not released while Redis does not answer")

	// Down after the row was deleted: released, and said to be stale.
	rp.Start(t)
	testsvc.Eventually(t, 15*time.Second, func() bool { return client.Ping(ctx).Err() == nil }, "client reconnects")
	b.ledger.SetRedisHooks(nil, func(inbox.Key) { rp.Stop(t) })
	ok, err = b.ledger.Release(ctx, r.Key)
	require.True(t, ok, "the row is gone: the caller must know")
	require.ErrorIs(t, err, inbox.ErrCacheStale)
	require.NotErrorIs(t, err, inbox.ErrCacheUnavailable)
	require.Contains(t, err.Error(), "stale cached answer may be served")
	require.Equal(t, 0, count(r.ID))

	// RecordFailure, Redis gone after the row was written.
	f := req("orders", "down-fail")
	ok, err = b.ledger.RecordFailure(ctx, f, 3, errors.New("bad payload"))
	require.True(t, ok)
	require.ErrorIs(t, err, inbox.ErrCacheStale)
	require.Equal(t, 1, count(f.ID), "dead-lettering is recorded without Redis")

	b.ledger.SetRedisHooks(nil, nil)
	rp.Start(t)
	testsvc.Eventually(t, 15*time.Second, func() bool { return client.Ping(ctx).Err() == nil }, "client reconnects")
	ok, err = b.ledger.Release(ctx, f.Key)
	require.NoError(t, err)
	require.True(t, ok)
}

// TestReleasedFailedKeyRunsAgainWithRedis: a key recorded failed is
// answered failed (and that answer is cached); once released, the next
// delivery runs the handler.
func TestReleasedFailedKeyRunsAgainWithRedis(t *testing.T) {
	t.Parallel()
	c, prefix := testsvc.Redis(t)
	b := redisLedger(t, inbox.RedisConfig{Client: c, Prefix: prefix})
	ctx := context.Background()
	r := req("orders", "poison")
	resKey, _ := b.ledger.RedisKeys(r.Key)
	var ran atomic.Int64

	ok, err := b.ledger.RecordFailure(ctx, r, 5, errors.New("bad payload"))
	require.NoError(t, err)
	require.True(t, ok)
	for i, cached := range []bool{false, true} {
		out, err := b.ledger.Do(ctx, r, pay("x", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.Equal(t, inbox.StatusFailed, out.Record.Status)
		require.Equal(t, cached, out.Cached, "call %d", i)
	}
	require.EqualValues(t, 1, c.Exists(ctx, resKey).Val(), "the failed status is cached")

	// Recording the failure again (more attempts) drops the cached copy.
	ok, err = b.ledger.RecordFailure(ctx, r, 6, errors.New("still bad"))
	require.NoError(t, err)
	require.True(t, ok)
	require.Zero(t, c.Exists(ctx, resKey).Val())
	out, err := b.ledger.Do(ctx, r, pay("x", &ran))
	require.NoError(t, err)
	require.Equal(t, 6, out.Record.Attempts)
	require.Equal(t, "still bad", out.Record.Error)

	ok, err = b.ledger.Release(ctx, r.Key)
	require.NoError(t, err)
	require.True(t, ok)
	out, err = b.ledger.Do(ctx, r, pay("x", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.EqualValues(t, 1, ran.Load())
}

// TestRedisCancelledContext: on the Redis path a cancelled context is the
// caller's error, never InFlight with a nil error, and not a Redis failure.
func TestRedisCancelledContext(t *testing.T) {
	t.Parallel()
	c, prefix := testsvc.Redis(t)
	logs := &countingHandler{}
	b := setup(t, inbox.Config{Logger: slog.New(logs), Redis: &inbox.RedisConfig{Client: c, Prefix: prefix, Timeout: 2 * time.Second}},
		testsvc.MaxConns(4))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()

	r := req("orders", "cancelled")
	out, err := b.ledger.Do(ctx, r, pay("p", nil))
	require.ErrorIs(t, err, context.Canceled)
	require.Zero(t, out.Disposition)

	// A key held by another caller: still the context's error.
	_, lockKey := b.ledger.RedisKeys(r.Key)
	require.NoError(t, c.Set(context.Background(), lockKey, "someone-else", time.Minute).Err())
	for _, wait := range []time.Duration{0, time.Second} {
		rw := r
		rw.LockWait = wait
		out, err = b.ledger.Do(ctx, rw, pay("p", nil))
		require.ErrorIs(t, err, context.Canceled, "lock wait %s", wait)
		require.NotEqual(t, inbox.InFlight, out.Disposition)
	}
	// Release with a cancelled context changes nothing.
	ok, err := b.ledger.Release(ctx, r.Key)
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, ok)

	require.Zero(t, b.ledger.Counters().RedisFallbacks, "a caller's cancellation is not a Redis failure")
	require.Zero(t, logs.warn.Load())
	out, err = b.ledger.Do(context.Background(), inbox.Request{Key: inbox.Key{Scope: "orders", ID: "after"}}, func(context.Context, pgx.Tx) (inbox.Result, error) {
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
}

// Release whose DELETE commits but whose answer is lost (the connection
// cut after the server sent it): Release fails, yet the key's cached
// result is gone with the row, so the next delivery runs the handler
// instead of being answered from the old result.
func TestReleaseAnswerLostStillDropsTheCache(t *testing.T) {
	t.Parallel()
	client, prefix := testsvc.Redis(t)
	b := setup(t, inbox.Config{})
	proxy := testsvc.Proxy(t, b.pg.Host())
	pool := b.pg.PoolVia(t, proxy.Addr(), 2)
	l, err := inbox.New(pool, inbox.Config{Redis: &inbox.RedisConfig{Client: client, Prefix: prefix, Timeout: 2 * time.Second}})
	require.NoError(t, err)
	ctx := context.Background()
	r := req("orders", "released")
	var ran atomic.Int64
	for range 2 {
		_, err := l.Do(ctx, r, pay("p1", &ran))
		require.NoError(t, err)
	}
	out, err := l.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	require.True(t, out.Cached, "the result is cached")

	fired := proxy.CutWhenServerSends([]byte("DELETE 1\x00"))
	_, err = l.Release(ctx, r.Key)
	select {
	case <-fired:
	default:
		t.Fatalf("the fault did not fire: the DELETE's answer was never seen (err %v)", err)
	}
	require.ErrorIs(t, err, inbox.ErrStore)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'released'`), "the DELETE committed")

	b.pg.Exec(t, `DELETE FROM payments`)
	out, err = l.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition, "not answered from the old cached result")
	require.EqualValues(t, 2, ran.Load())
}

// ReleaseStuck deletes only what cannot be in use: a failed key, a lease
// that ran out, an expired row. A done key and a lease that still runs
// stay, with ErrNotStuck, whatever the caller saw of them before.
func TestReleaseStuckLeavesWhatMayBeInUse(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b := setupLayout(t, mc, inbox.Config{})
		ctx := context.Background()

		// Done: left, and still done.
		done := req("orders", "done")
		_, err := b.ledger.Do(ctx, done, noop)
		require.NoError(t, err)
		ok, err := b.ledger.ReleaseStuck(ctx, done.Key)
		require.ErrorIs(t, err, inbox.ErrNotStuck)
		require.False(t, ok)
		out, err := b.ledger.Do(ctx, done, noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition, "the done key was not released")

		// A lease that runs: left, and its holder still completes.
		live := req("orders", "live")
		lease, _, err := b.ledger.AcquireLease(ctx, live, time.Hour)
		require.NoError(t, err)
		require.NotNil(t, lease)
		ok, err = b.ledger.ReleaseStuck(ctx, live.Key)
		require.ErrorIs(t, err, inbox.ErrNotStuck)
		require.False(t, ok)
		require.NoError(t, lease.Complete(ctx, inbox.Result{Code: 200}))

		// A lease that runs past its row's expiry: left too.
		longLease := req("orders", "long-lease")
		longLease.TTL = time.Second
		lease, _, err = b.ledger.AcquireLease(ctx, longLease, time.Hour)
		require.NoError(t, err)
		require.NotNil(t, lease)
		testsvc.Eventually(t, 10*time.Second, func() bool {
			_, err := b.ledger.Lookup(ctx, longLease.Key)
			return errors.Is(err, inbox.ErrNotFound)
		}, "the row expired")
		ok, err = b.ledger.ReleaseStuck(ctx, longLease.Key)
		require.ErrorIs(t, err, inbox.ErrNotStuck)
		require.False(t, ok)
		require.NoError(t, lease.Complete(ctx, inbox.Result{Code: 200}))

		// A lease that ran out: released, and its holder is fenced off.
		stale := req("orders", "stale")
		lease, _, err = b.ledger.AcquireLease(ctx, stale, 50*time.Millisecond)
		require.NoError(t, err)
		require.NotNil(t, lease)
		testsvc.Eventually(t, 10*time.Second, func() bool {
			ok, err = b.ledger.ReleaseStuck(ctx, stale.Key)
			if errors.Is(err, inbox.ErrNotStuck) {
				return false
			}
			require.NoError(t, err)
			return true
		}, "the lease ran out and the key was released")
		require.True(t, ok)
		require.ErrorIs(t, lease.Complete(ctx, inbox.Result{}), inbox.ErrLeaseLost)

		// Failed: released; the next delivery runs.
		failed := req("orders", "failed")
		_, err = b.ledger.RecordFailure(ctx, failed, 3, errors.New("boom"))
		require.NoError(t, err)
		ok, err = b.ledger.ReleaseStuck(ctx, failed.Key)
		require.NoError(t, err)
		require.True(t, ok)
		out, err = b.ledger.Do(ctx, failed, noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)

		// Absent: false, no error.
		ok, err = b.ledger.ReleaseStuck(ctx, req("orders", "absent").Key)
		require.NoError(t, err)
		require.False(t, ok)
	})
}
