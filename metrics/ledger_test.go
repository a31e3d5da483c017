package metrics_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/metrics"
)

func TestLedgerCollector(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testsvc.Postgres(t)
	rc, prefix := testsvc.Redis(t)
	l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema, Redis: &inbox.RedisConfig{Client: rc, Prefix: prefix}})
	require.NoError(t, err)
	// A second ledger on the same table whose Redis is down.
	deadRedis := testsvc.NewRedisClient("127.0.0.1:1")
	t.Cleanup(func() { _ = deadRedis.Close() })
	l2, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema, Redis: &inbox.RedisConfig{Client: deadRedis, Prefix: prefix}})
	require.NoError(t, err)

	// Two ledgers in one registry: a label tells them apart.
	reg := prometheus.NewRegistry()
	prometheus.WrapRegistererWith(prometheus.Labels{"ledger": "main"}, reg).
		MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{}))
	prometheus.WrapRegistererWith(prometheus.Labels{"ledger": "fallback"}, reg).
		MustRegister(metrics.NewLedgerCollector(l2, metrics.LedgerConfig{DisableStats: true}))

	req := func(scope, id string, fp ...byte) inbox.Request {
		return inbox.Request{Key: inbox.Key{Scope: scope, ID: id}, Source: inbox.Source("kafka"), Fingerprint: fp}
	}
	want := func(r inbox.Request, fn inbox.TxFunc, d inbox.Disposition, cached bool) {
		t.Helper()
		out, err := l.Do(ctx, r, fn)
		require.NoError(t, err)
		require.Equal(t, d, out.Disposition)
		if d == inbox.Duplicate {
			require.Equal(t, cached, out.Cached)
		}
	}

	// Four executed, in scope billing.
	for _, id := range []string{"a", "b", "c"} {
		want(req("billing", id), result(inbox.Result{Code: 200}), inbox.Executed, false)
	}
	want(req("billing", "d", 1), result(inbox.Result{}), inbox.Executed, false)
	// Two duplicates from the Redis replay cache, one from Postgres (the
	// key ran through the other ledger, so Redis never saw it).
	want(req("billing", "a"), result(inbox.Result{}), inbox.Duplicate, true)
	want(req("billing", "a"), result(inbox.Result{}), inbox.Duplicate, true)
	out, err := l2.Do(ctx, req("billing", "x"), result(inbox.Result{}))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	want(req("billing", "x"), result(inbox.Result{}), inbox.Duplicate, false)
	// One fingerprint mismatch (found in the cache or in Postgres: it is
	// not a cache replay either way).
	want(req("billing", "d", 2), result(inbox.Result{}), inbox.Mismatch, false)
	// One error: the handler failed; nothing is recorded.
	_, err = l.Do(ctx, req("billing", "e"), func(context.Context, pgx.Tx) (inbox.Result, error) {
		return inbox.Result{}, errors.New("boom")
	})
	require.EqualError(t, err, "boom")
	// One in flight: a lease holds the key.
	lease, _, err := l.AcquireLease(ctx, req("payments", "p1"), 100*time.Millisecond)
	require.NoError(t, err)
	require.NotNil(t, lease)
	want(req("payments", "p1"), result(inbox.Result{}), inbox.InFlight, false)
	// One lease lost: the lease runs out, another caller takes the key
	// over (and crashes in turn, leaving a stuck key), the first one
	// completes too late.
	time.Sleep(150 * time.Millisecond)
	lease2, _, err := l.AcquireLease(ctx, req("payments", "p1"), 50*time.Millisecond)
	require.NoError(t, err)
	require.NotNil(t, lease2)
	require.ErrorIs(t, lease.Complete(ctx, inbox.Result{}), inbox.ErrLeaseLost)
	time.Sleep(100 * time.Millisecond)

	got := samples(t, reg)
	require.Equal(t, map[string]float64{
		`justonce_ledger_calls_total{disposition="executed",ledger="main"}`:  4,
		`justonce_ledger_calls_total{disposition="duplicate",ledger="main"}`: 3,
		`justonce_ledger_calls_total{disposition="in_flight",ledger="main"}`: 1,
		`justonce_ledger_calls_total{disposition="mismatch",ledger="main"}`:  1,
		`justonce_ledger_calls_total{disposition="error",ledger="main"}`:     1,
		`justonce_ledger_cache_replays_total{ledger="main"}`:                 2,
		`justonce_ledger_redis_fallbacks_total{ledger="main"}`:               0,
		`justonce_ledger_leases_lost_total{ledger="main"}`:                   1,
		// The other ledger: one call, executed, with Redis down.
		`justonce_ledger_calls_total{disposition="executed",ledger="fallback"}`:  1,
		`justonce_ledger_calls_total{disposition="duplicate",ledger="fallback"}`: 0,
		`justonce_ledger_calls_total{disposition="in_flight",ledger="fallback"}`: 0,
		`justonce_ledger_calls_total{disposition="mismatch",ledger="fallback"}`:  0,
		`justonce_ledger_calls_total{disposition="error",ledger="fallback"}`:     0,
		`justonce_ledger_cache_replays_total{ledger="fallback"}`:                 0,
		`justonce_ledger_redis_fallbacks_total{ledger="fallback"}`:               1,
		`justonce_ledger_leases_lost_total{ledger="fallback"}`:                   0,
	}, only(got, "justonce_ledger_calls_total", "justonce_ledger_cache_replays_total",
		"justonce_ledger_redis_fallbacks_total", "justonce_ledger_leases_lost_total"))

	// The table, as the database sees it.
	overdue := got[`justonce_ledger_oldest_lease_overdue_seconds{ledger="main",scope="payments"}`]
	require.Greater(t, overdue, 0.05, "the stuck lease ran out ~100 ms ago")
	require.Less(t, overdue, 30.0)
	require.Equal(t, map[string]float64{
		`justonce_ledger_rows{ledger="main",scope="billing",status="done"}`:            5,
		`justonce_ledger_rows{ledger="main",scope="payments",status="processing"}`:     1,
		`justonce_ledger_oldest_lease_overdue_seconds{ledger="main",scope="payments"}`: overdue,
		`justonce_ledger_stats_up{ledger="main"}`:                                      1,
	}, only(got, "justonce_ledger_rows", "justonce_ledger_oldest_lease_overdue_seconds", "justonce_ledger_stats_up"))

	// The stuck key is released: its row and its lease gauge go away.
	ok, err := l.Release(ctx, inbox.Key{Scope: "payments", ID: "p1"})
	require.NoError(t, err)
	require.True(t, ok)
	got = samples(t, reg)
	require.Equal(t, map[string]float64{
		`justonce_ledger_rows{ledger="main",scope="billing",status="done"}`: 5,
		`justonce_ledger_stats_up{ledger="main"}`:                           1,
	}, only(got, "justonce_ledger_rows", "justonce_ledger_oldest_lease_overdue_seconds", "justonce_ledger_stats_up"))
}

func TestLedgerCollectorStats(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testsvc.Postgres(t)
	l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema})
	require.NoError(t, err)
	do := func(id string) {
		_, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "s", ID: id}}, result(inbox.Result{}))
		require.NoError(t, err)
	}
	rows := `justonce_ledger_rows{scope="s",status="done"}`

	t.Run("cached", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{StatsMaxAge: time.Hour}))
		do("1")
		require.Equal(t, 1.0, samples(t, reg)[rows])
		do("2")
		got := samples(t, reg)
		require.Equal(t, 1.0, got[rows], "within StatsMaxAge the last answer is reused")
		require.Equal(t, 2.0, got[`justonce_ledger_calls_total{disposition="executed"}`], "counters are always current")

		fresh := prometheus.NewRegistry()
		fresh.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{}))
		require.Equal(t, 2.0, samples(t, fresh)[rows])
	})

	t.Run("disabled", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{DisableStats: true}))
		got := samples(t, reg)
		require.Empty(t, only(got, "justonce_ledger_rows", "justonce_ledger_stats_up"))
		require.Equal(t, 2.0, got[`justonce_ledger_calls_total{disposition="executed"}`])
	})

	t.Run("database down", func(t *testing.T) {
		// A ledger whose database is gone: the scrape still succeeds, with
		// the counters and stats_up 0.
		pool, err := pgxpool.New(ctx, pg.URL)
		require.NoError(t, err)
		down, err := inbox.New(pool, inbox.Config{Schema: pg.Schema})
		require.NoError(t, err)
		_, err = down.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "s", ID: "3"}}, result(inbox.Result{}))
		require.NoError(t, err)
		pool.Close()
		_, err = down.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "s", ID: "4"}}, result(inbox.Result{}))
		require.ErrorIs(t, err, inbox.ErrStore)

		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.NewLedgerCollector(down, metrics.LedgerConfig{StatsTimeout: 500 * time.Millisecond}))
		got := samples(t, reg)
		require.Equal(t, 0.0, got[`justonce_ledger_stats_up`])
		require.Empty(t, only(got, "justonce_ledger_rows", "justonce_ledger_oldest_lease_overdue_seconds"))
		require.Equal(t, 1.0, got[`justonce_ledger_calls_total{disposition="executed"}`])
		require.Equal(t, 1.0, got[`justonce_ledger_calls_total{disposition="error"}`])
	})

	t.Run("timeout", func(t *testing.T) {
		// The rows query waits on a lock a transaction holds: the scrape
		// gives up after StatsTimeout.
		tx, err := pg.Pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = tx.Exec(ctx, "LOCK TABLE processed_events IN ACCESS EXCLUSIVE MODE")
		require.NoError(t, err)

		reg := prometheus.NewRegistry()
		reg.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{StatsTimeout: 200 * time.Millisecond}))
		start := time.Now()
		got := samples(t, reg)
		require.Less(t, time.Since(start), 5*time.Second)
		require.Equal(t, 0.0, got[`justonce_ledger_stats_up`])
	})
}

// Steps run, by kind, and steps resumed: a payment of a Postgres step and
// an outside call fails after them; its retry resumes after both, and a
// second payment fails permanently, compensating its call.
func TestLedgerCollectorSteps(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testsvc.Postgres(t)
	l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{DisableStats: true}))

	var last error
	pay := func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		if _, err := s.Tx(ctx, "order", func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
			return inbox.Result{}, err
		}
		s.Compensate("charge", func(context.Context, string, []byte) error { return nil })
		if _, err := s.Call(ctx, "charge", func(context.Context, string) ([]byte, error) { return nil, nil }); err != nil {
			return inbox.Result{}, err
		}
		return inbox.Result{}, last
	}
	r := inbox.Request{Key: inbox.Key{Scope: "payments", ID: "p1"}}
	last = errors.New("mailer down")
	_, err = l.DoSteps(ctx, r, 0, pay)
	require.Error(t, err)
	last = nil
	_, err = l.DoSteps(ctx, r, 0, pay)
	require.NoError(t, err)
	last = inbox.Permanent(errors.New("declined"))
	_, err = l.DoSteps(ctx, inbox.Request{Key: inbox.Key{Scope: "payments", ID: "p2"}}, 0, pay)
	require.ErrorIs(t, err, inbox.ErrPermanent)

	require.Equal(t, map[string]float64{
		`justonce_ledger_steps_total{kind="tx"}`:         2,
		`justonce_ledger_steps_total{kind="call"}`:       2,
		`justonce_ledger_steps_total{kind="compensate"}`: 1,
		`justonce_ledger_steps_resumed_total`:            2,
	}, only(samples(t, reg), "justonce_ledger_steps_total", "justonce_ledger_steps_resumed_total"))
}
