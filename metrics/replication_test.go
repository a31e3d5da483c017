package metrics_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/metrics"
)

// TestLedgerCollectorReplication: with Replication, a scrape says whether
// the ledger's database has its commits on a standby before acknowledging
// them; the test server has no standby, so they are not durable across a
// failover. Without it, nothing is asked. A database that does not answer
// gives replication_up 0 and no replication gauges. (The replica sets of
// harness/failover cover a synchronous and an asynchronous standby.)
func TestLedgerCollectorReplication(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testsvc.Postgres(t)
	l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema})
	require.NoError(t, err)
	names := []string{"justonce_ledger_commit_durable", "justonce_ledger_standbys", "justonce_ledger_sync_standbys",
		"justonce_ledger_replication_up", "justonce_ledger_redis_recoveries_total"}

	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{Replication: true, DisableStats: true}))
	require.Equal(t, map[string]float64{
		"justonce_ledger_commit_durable":         0,
		"justonce_ledger_standbys":               0,
		"justonce_ledger_sync_standbys":          0,
		"justonce_ledger_replication_up":         1,
		"justonce_ledger_redis_recoveries_total": 0,
	}, only(samples(t, reg), names...))

	plain := prometheus.NewRegistry()
	plain.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{DisableStats: true}))
	require.Equal(t, map[string]float64{"justonce_ledger_redis_recoveries_total": 0}, only(samples(t, plain), names...))

	pool, err := pgxpool.New(ctx, pg.URL)
	require.NoError(t, err)
	down, err := inbox.New(pool, inbox.Config{Schema: pg.Schema})
	require.NoError(t, err)
	pool.Close()
	gone := prometheus.NewRegistry()
	gone.MustRegister(metrics.NewLedgerCollector(down, metrics.LedgerConfig{Replication: true, DisableStats: true, StatsTimeout: 500 * time.Millisecond}))
	require.Equal(t, map[string]float64{
		"justonce_ledger_replication_up":         0,
		"justonce_ledger_redis_recoveries_total": 0,
	}, only(samples(t, gone), names...))
}
