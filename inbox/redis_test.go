package inbox_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

func redisLedger(t *testing.T, rc inbox.RedisConfig) *bundle {
	t.Helper()
	if rc.Timeout == 0 {
		// These tests are about the lock and the cache, not timeouts: on a
		// loaded 2-core machine with -race a 50 ms deadline would send
		// calls to the Postgres fallback (correctly, but beside the point).
		rc.Timeout = 2 * time.Second
	}
	if rc.Client == nil {
		c, prefix := testsvc.Redis(t)
		rc.Client, rc.Prefix = c, prefix
	}
	return setup(t, inbox.Config{Redis: &rc}, testsvc.MaxConns(8))
}

// TestRedisLosersFailFastWithoutPostgres: 200 racers on one key; the winner
// holds it until the 199 others were all answered InFlight by Redis, none
// of them taking a Postgres connection.
func TestRedisLosersFailFastWithoutPostgres(t *testing.T) {
	t.Parallel()
	b := redisLedger(t, inbox.RedisConfig{})
	ctx := context.Background()
	before := b.pg.Pool.Stat().AcquireCount()
	var ran atomic.Int64
	var counts [5]atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < 200; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			out, err := b.ledger.Do(ctx, req("orders", "hot"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				// The winner holds the key until every other racer was
				// turned away: real contention, not a sequential run.
				deadline := time.Now().Add(60 * time.Second)
				for counts[inbox.InFlight].Load() < 199 {
					if time.Now().After(deadline) {
						return inbox.Result{}, fmt.Errorf("only %d racers turned away while the key was held", counts[inbox.InFlight].Load())
					}
					time.Sleep(time.Millisecond)
				}
				return pay("p1", &ran)(ctx, tx)
			})
			if err != nil {
				t.Error(err)
				return
			}
			counts[out.Disposition].Add(1)
		}()
	}
	close(start)
	wg.Wait()
	require.EqualValues(t, 1, ran.Load())
	require.EqualValues(t, 1, counts[inbox.Executed].Load())
	require.EqualValues(t, 199, counts[inbox.InFlight].Load(), "every loser was turned away while the winner ran")
	// Only the winner took a Postgres connection.
	require.EqualValues(t, 1, b.pg.Pool.Stat().AcquireCount()-before)
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments`))

	// A duplicate now is answered from the cache, still without Postgres.
	before = b.pg.Pool.Stat().AcquireCount()
	out, err := b.ledger.Do(ctx, req("orders", "hot"), pay("p1", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.True(t, out.Cached)
	require.Equal(t, `{"id":"p1"}`, string(out.Result.Body))
	require.EqualValues(t, 0, b.pg.Pool.Stat().AcquireCount()-before)
}

func TestRedisLockOwnership(t *testing.T) {
	t.Parallel()
	c, prefix := testsvc.Redis(t)
	b := redisLedger(t, inbox.RedisConfig{Client: c, Prefix: prefix, LockTTL: 300 * time.Millisecond})
	ctx := context.Background()
	k := req("orders", "locked")
	_, lockKey := b.ledger.RedisKeys(k.Key)

	// A holder that crashed left its lock: others are turned away...
	require.NoError(t, c.Set(ctx, lockKey, "someone-else", 300*time.Millisecond).Err())
	out, err := b.ledger.Do(ctx, k, pay("p", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.InFlight, out.Disposition)
	// ...and the lock is never released by a non-owner.
	v, err := c.Get(ctx, lockKey).Result()
	require.NoError(t, err)
	require.Equal(t, "someone-else", v)

	// Once it expires the key is taken over.
	testsvc.Eventually(t, 5*time.Second, func() bool {
		out, err = b.ledger.Do(ctx, k, pay("p", nil))
		require.NoError(t, err)
		return out.Disposition == inbox.Executed
	}, "expired lock taken over")
	// Our own lock is gone after the run; a foreign one set meanwhile stays.
	require.Zero(t, c.Exists(ctx, lockKey).Val())

	// A long handler keeps its lock alive past LockTTL.
	long := req("orders", "long")
	_, longLock := b.ledger.RedisKeys(long.Key)
	var others atomic.Int64
	out, err = b.ledger.Do(ctx, long, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		deadline := time.Now().Add(time.Second) // > 3 × LockTTL
		for time.Now().Before(deadline) {
			if c.Exists(ctx, longLock).Val() != 1 {
				return inbox.Result{}, fmt.Errorf("lock lapsed while the handler ran")
			}
			others.Add(1)
			time.Sleep(20 * time.Millisecond)
		}
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
}

func TestRedisCacheFollowsTheLedger(t *testing.T) {
	t.Parallel()
	c, prefix := testsvc.Redis(t)
	b := redisLedger(t, inbox.RedisConfig{Client: c, Prefix: prefix})
	ctx := context.Background()
	var ran atomic.Int64

	// Expiry: the cache entry lives as long as the row.
	r := req("orders", "ttl")
	r.TTL = 400 * time.Millisecond
	_, err := b.ledger.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	resKey, _ := b.ledger.RedisKeys(r.Key)
	pttl := c.PTTL(ctx, resKey).Val()
	require.Greater(t, pttl, time.Duration(0))
	require.LessOrEqual(t, pttl, 400*time.Millisecond)
	out, err := b.ledger.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	require.True(t, out.Cached)
	testsvc.Eventually(t, 5*time.Second, func() bool {
		out, err = b.ledger.Do(ctx, r, pay(fmt.Sprintf("p-%d", ran.Load()+1), &ran))
		require.NoError(t, err)
		return out.Disposition == inbox.Executed
	}, "key new again after expiry")
	require.EqualValues(t, 2, ran.Load())

	// Release: a released row is not replayed from a stale cache.
	r2 := req("orders", "rel")
	_, err = b.ledger.Do(ctx, r2, pay("r1", &ran))
	require.NoError(t, err)
	out, err = b.ledger.Do(ctx, r2, pay("r1", &ran))
	require.NoError(t, err)
	require.True(t, out.Cached)
	ok, err := b.ledger.Release(ctx, r2.Key)
	require.NoError(t, err)
	require.True(t, ok)
	out, err = b.ledger.Do(ctx, r2, pay("r2", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.False(t, out.Cached)

	// A mismatch is answered from the cache too.
	r3 := req("orders", "fp")
	r3.Fingerprint = []byte("a")
	_, err = b.ledger.Do(ctx, r3, pay("f1", &ran))
	require.NoError(t, err)
	r3.Fingerprint = []byte("b")
	out, err = b.ledger.Do(ctx, r3, pay("f2", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Mismatch, out.Disposition)
	require.True(t, out.Cached)

	// Results over the size cap are served by Postgres, whole.
	small := redisLedger(t, inbox.RedisConfig{Client: c, Prefix: prefix + "small:", MaxCachedBytes: 64})
	big := make([]byte, 4096)
	r4 := req("orders", "big")
	_, err = small.ledger.Do(ctx, r4, func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{Body: big}, nil })
	require.NoError(t, err)
	out, err = small.ledger.Do(ctx, r4, pay("x", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.False(t, out.Cached)
	require.Len(t, out.Result.Body, 4096)
}

// TestRedisOutage stops Redis in the middle of 5,000 keyed operations with
// duplicates and starts it again: nothing doubles, nothing is lost, work
// goes on through Postgres, the fallback is counted, and the fast path
// comes back.
func TestRedisOutage(t *testing.T) {
	t.Parallel()
	rp := testsvc.StartRedis(t)
	client := testsvc.NewRedisClient(rp.Addr)
	t.Cleanup(func() { _ = client.Close() })
	logs := &countingHandler{}
	b := setup(t, inbox.Config{Logger: slog.New(logs), Redis: &inbox.RedisConfig{Client: client, Timeout: time.Second}}, testsvc.MaxConns(8))
	ctx := context.Background()

	const ops, unique, workers = 5000, 2500, 8
	var next, done, doneWhileDown atomic.Int64
	var down atomic.Bool
	var maxLatency atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= ops {
					return
				}
				// Each key twice: once in the first half, once in the second
				// (j and j+unique), with neighbours overlapping.
				id := fmt.Sprintf("k-%d", i%unique)
				start := time.Now()
				for {
					out, err := b.ledger.Do(ctx, req("outage", id), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
						_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 1)`, id)
						return inbox.Result{Code: 200}, err
					})
					if err != nil {
						errs <- err
						return
					}
					if out.Disposition != inbox.InFlight {
						break
					}
					time.Sleep(time.Millisecond) // a client retrying an in-flight key
				}
				if d := time.Since(start).Nanoseconds(); d > maxLatency.Load() {
					maxLatency.Store(d)
				}
				done.Add(1)
				if down.Load() {
					doneWhileDown.Add(1)
				}
			}
		}()
	}
	testsvc.Eventually(t, 60*time.Second, func() bool { return done.Load() >= 1500 }, "first third done")
	rp.Stop(t)
	down.Store(true)
	testsvc.Eventually(t, 60*time.Second, func() bool { return done.Load() >= 3000 }, "work goes on while Redis is down")
	down.Store(false)
	fallbacks := b.ledger.Counters().RedisFallbacks
	rp.Start(t)
	hitsAtRestart := b.ledger.Counters().CacheHits
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	// The client's pool recovers from the dial errors (go-redis retries
	// dialing in the background); then duplicates are cached again on one
	// pass and answered from Redis on the next.
	testsvc.Eventually(t, 15*time.Second, func() bool { return client.Ping(ctx).Err() == nil }, "client reconnects")
	for pass := 0; pass < 2; pass++ {
		for i := 0; i < unique; i++ {
			testsvc.Eventually(t, 15*time.Second, func() bool {
				out, err := b.ledger.Do(ctx, req("outage", fmt.Sprintf("k-%d", i)), pay("never", nil))
				require.NoError(t, err)
				require.NotEqual(t, inbox.Executed, out.Disposition)
				return out.Disposition == inbox.Duplicate
			}, "duplicate answered")
		}
	}
	require.EqualValues(t, ops, done.Load())
	require.Equal(t, unique, b.pg.Count(t, `SELECT count(*) FROM payments`), "0 lost, 0 doubled")
	require.Equal(t, unique, b.pg.Count(t, `SELECT count(*) FROM processed_events`))
	require.Greater(t, doneWhileDown.Load(), int64(100), "operations kept flowing without Redis")
	require.Greater(t, fallbacks, uint64(0), "fallbacks counted")
	c := b.ledger.Counters()
	require.Greater(t, c.CacheHits, hitsAtRestart, "fast path resumed after restart")
	require.EqualValues(t, 1, logs.warn.Load(), "one warning per outage episode, not per request")
	require.EqualValues(t, 1, logs.info.Load(), "one recovery notice")
	t.Logf("ops=%d while-down=%d fallbacks=%d cache-hits=%d max-latency=%s",
		done.Load(), doneWhileDown.Load(), c.RedisFallbacks, c.CacheHits, time.Duration(maxLatency.Load()))
}

// countingHandler counts log records by level.
type countingHandler struct{ warn, info atomic.Int64 }

func (h *countingHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countingHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *countingHandler) WithGroup(string) slog.Handler            { return h }
func (h *countingHandler) Handle(_ context.Context, r slog.Record) error {
	switch {
	case r.Level >= slog.LevelWarn:
		h.warn.Add(1)
	case r.Level == slog.LevelInfo:
		h.info.Add(1)
	}
	return nil
}

func TestRedisLockReleasedWhenHandlerPanics(t *testing.T) {
	t.Parallel()
	b := redisLedger(t, inbox.RedisConfig{})
	ctx := context.Background()
	r := req("orders", "panics")
	func() {
		defer func() { require.Equal(t, "boom", recover()) }()
		_, _ = b.ledger.Do(ctx, r, func(context.Context, pgx.Tx) (inbox.Result, error) { panic("boom") })
	}()
	out, err := b.ledger.Do(ctx, r, pay("p", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition, "the retry runs: the lock was released")
}

// Two ledgers in different schemas sharing one Redis (and one RedisConfig),
// with the default prefix: a key done in one is not answered from the
// cache in the other.
func TestRedisDefaultPrefixNamesTheSchema(t *testing.T) {
	t.Parallel()
	client, _ := testsvc.Redis(t)
	ctx := context.Background()
	rc := &inbox.RedisConfig{Client: client, Timeout: 2 * time.Second}
	var ledgers []*inbox.Ledger
	for range 2 {
		pg := testsvc.Postgres(t)
		l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema, Redis: rc})
		require.NoError(t, err)
		ledgers = append(ledgers, l)
	}
	id := testsvc.Unique("shared")
	for range 2 { // the second answer comes from the cache
		_, err := ledgers[0].Do(ctx, req("orders", id), noop)
		require.NoError(t, err)
	}
	ran := false
	out, err := ledgers[1].Do(ctx, req("orders", id), func(context.Context, pgx.Tx) (inbox.Result, error) {
		ran = true
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.True(t, ran, "the other ledger's key is new here")
	require.False(t, out.Cached)
}

// A cached entry leaves Redis a second before its row expires (a tenth of
// a TTL under ten seconds).
func TestRedisEntryGoesBeforeItsRow(t *testing.T) {
	t.Parallel()
	client, prefix := testsvc.Redis(t)
	b := redisLedger(t, inbox.RedisConfig{Client: client, Prefix: prefix})
	ctx := context.Background()
	r := req("orders", "short")
	r.TTL = 30 * time.Second
	for range 2 {
		_, err := b.ledger.Do(ctx, r, noop)
		require.NoError(t, err)
	}
	rec, err := b.ledger.Lookup(ctx, r.Key)
	require.NoError(t, err)
	res, _ := b.ledger.RedisKeys(r.Key)
	left, err := client.PTTL(ctx, res).Result()
	require.NoError(t, err)
	require.Positive(t, left, "cached")
	require.LessOrEqual(t, left, time.Until(rec.ExpiresAt)-time.Second+50*time.Millisecond)
}

// cancelAfter is a go-redis hook that, once armed, cancels a context right
// after the next command's answer has arrived: the caller gave up just as
// Redis had done what it asked.
type cancelAfter struct {
	armed  atomic.Bool
	cancel context.CancelFunc
}

func (h *cancelAfter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *cancelAfter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *cancelAfter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if h.armed.CompareAndSwap(true, false) {
			h.cancel()
		}
		return err
	}
}

// A Do whose caller gives up right after Redis took the key's lock, before
// the answer reached it, releases the lock: a retry runs at once instead
// of being turned away as in flight until the lock lapses.
func TestRedisLockReleasedWhenCallerGivesUpDuringAcquire(t *testing.T) {
	t.Parallel()
	c, prefix := testsvc.Redis(t)
	b := redisLedger(t, inbox.RedisConfig{Client: c, Prefix: prefix, LockTTL: time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	h := &cancelAfter{cancel: cancel}
	c.AddHook(h)
	h.armed.Store(true)
	r := req("orders", "given-up")
	_, err := b.ledger.Do(ctx, r, pay("p", nil))
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, h.armed.Load(), "the caller gave up after a Redis command")

	out, err := b.ledger.Do(context.Background(), r, pay("p", nil))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition, "the retry runs: the lock was released")
}
