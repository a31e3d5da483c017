package migrations_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/migrations"
)

func tableExists(t *testing.T, pg *testsvc.PG, schema string) bool {
	var ok bool
	require.NoError(t, pg.Pool.QueryRow(context.Background(),
		`SELECT to_regclass(quote_ident($1) || '.processed_events') IS NOT NULL`, schema).Scan(&ok))
	return ok
}

func TestUpDownUp(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	ctx := context.Background()
	schema := pg.Schema + "_ledger" // a schema other than the search_path
	t.Cleanup(func() { _, _ = pg.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS "`+schema+`" CASCADE`) })
	m := migrations.New(pg.Pool, migrations.Config{Schema: schema})

	all := versions(t)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, st.Version)
	require.Equal(t, all, st.Pending)

	res, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, all, res.Applied)
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'outbox'`, schema))
	require.True(t, tableExists(t, pg, schema))
	require.False(t, tableExists(t, pg, pg.Schema), "nothing lands in the search_path schema")

	res, err = m.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, res.Applied, "up again is a no-op")

	res, err = m.Down(ctx)
	require.NoError(t, err)
	require.Equal(t, reversed(all), res.Applied)
	require.False(t, tableExists(t, pg, schema))
	require.Zero(t, pg.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'outbox'`, schema))

	_, err = m.Up(ctx)
	require.NoError(t, err)
	st, err = m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, m.Latest(), st.Version)
	require.Empty(t, st.Pending)

	_, err = m.Migrate(ctx, 99)
	require.True(t, errors.Is(err, migrations.ErrUnknownVersion))
}

func TestConcurrentMigrators(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate(), testsvc.MaxConns(10))
	ctx := context.Background()
	var wg sync.WaitGroup
	applied := make([][]int, 6)
	errs := make([]error, 6)
	for i := range applied {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := migrations.New(pg.Pool, migrations.Config{}).Up(ctx)
			applied[i], errs[i] = res.Applied, err
		}()
	}
	wg.Wait()
	total := 0
	for i := range applied {
		require.NoError(t, errs[i])
		total += len(applied[i])
	}
	n := len(versions(t))
	require.Equal(t, n, total, "exactly one instance applies each migration")
	require.True(t, tableExists(t, pg, pg.Schema))
	require.Equal(t, n, pg.Count(t, `SELECT count(*) FROM justonce_migrations`))
}

func TestFilesArePlainAndPaired(t *testing.T) {
	t.Parallel()
	all, err := migrations.All()
	require.NoError(t, err)
	require.NotEmpty(t, all)
	for i, m := range all {
		if i > 0 {
			// Versions may have gaps: numbers are taken by changes made side
			// by side, and a build may hold some of them only.
			require.Greater(t, m.Version, all[i-1].Version, "versions ascend")
		}
		require.NotContains(t, m.Up, "{{", "no templating: golang-migrate users take the files as they are")
	}
	require.Subset(t, versions(t), []int{1, 2, 5}, "the ledger, the outbox, the outbox's partition")
}

// versions returns the versions this build knows, in order.
func versions(t *testing.T) []int {
	t.Helper()
	all, err := migrations.All()
	require.NoError(t, err)
	vs := make([]int, len(all))
	for i, m := range all {
		vs[i] = m.Version
	}
	return vs
}

func reversed(vs []int) []int {
	out := slices.Clone(vs)
	slices.Reverse(out)
	return out
}

// Up applies every version the database lacks, below its current version
// too: a database migrated by a build that knew versions 1, 2 and 5 gets
// 3 and 4 from a build that knows them, after 5. Here version 2 (whose SQL
// can run again) stands for such a version.
func TestUpFillsGaps(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	ctx := context.Background()
	m := migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema})
	_, err := m.Up(ctx)
	require.NoError(t, err)
	pg.Exec(t, `DELETE FROM justonce_migrations WHERE version = 2`)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, m.Latest(), st.Version)
	require.Equal(t, []int{2}, st.Pending)
	res, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, []int{2}, res.Applied)
	require.Equal(t, m.Latest(), res.From)
	st, err = m.Status(ctx)
	require.NoError(t, err)
	require.Empty(t, st.Pending)
}

func TestTimeBucketLayout(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	ctx := context.Background()
	cfg := migrations.Config{Schema: pg.Schema, Layout: migrations.LayoutTimeBuckets, MaxTTL: time.Hour, BucketWidth: 15 * time.Minute}
	_, err := migrations.New(pg.Pool, cfg).Up(ctx)
	require.NoError(t, err)
	var kind string
	var parts int
	require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT relkind::text, (SELECT count(*) FROM pg_inherits WHERE inhparent = c.oid)
		FROM pg_class c WHERE c.oid = 'processed_events'::regclass`).Scan(&kind, &parts))
	require.Equal(t, "p", kind)
	require.Equal(t, migrations.DefaultShards, parts, "a bucket per shard")

	// Bad settings are refused before anything runs.
	bad := cfg
	bad.BucketWidth = 1500 * time.Millisecond
	_, err = migrations.New(pg.Pool, bad).Up(ctx)
	require.Error(t, err)
	_, err = migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema, Layout: "sharded"}).Up(ctx)
	require.Error(t, err)

	_, err = migrations.New(pg.Pool, cfg).Down(ctx)
	require.NoError(t, err)
	require.False(t, tableExists(t, pg, pg.Schema))
}
