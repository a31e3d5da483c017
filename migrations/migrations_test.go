package migrations_test

import (
	"context"
	"errors"
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

// embeddedVersions are the versions of the embedded migrations, in order
// and reversed: the tests assume no particular set of them.
func embeddedVersions(t *testing.T) (versions, reversed []int) {
	t.Helper()
	all, err := migrations.All()
	require.NoError(t, err)
	for i := range all {
		versions = append(versions, all[i].Version)
		reversed = append(reversed, all[len(all)-1-i].Version)
	}
	return versions, reversed
}

func TestUpDownUp(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	ctx := context.Background()
	schema := pg.Schema + "_ledger" // a schema other than the search_path
	t.Cleanup(func() { _, _ = pg.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS "`+schema+`" CASCADE`) })
	m := migrations.New(pg.Pool, migrations.Config{Schema: schema})
	versions, reversed := embeddedVersions(t)

	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, st.Version)
	require.Equal(t, versions, st.Pending)

	res, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, versions, res.Applied)
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'outbox'`, schema))
	require.True(t, tableExists(t, pg, schema))
	require.False(t, tableExists(t, pg, pg.Schema), "nothing lands in the search_path schema")

	res, err = m.Up(ctx)
	require.NoError(t, err)
	require.Empty(t, res.Applied, "up again is a no-op")

	res, err = m.Down(ctx)
	require.NoError(t, err)
	require.Equal(t, reversed, res.Applied)
	require.False(t, tableExists(t, pg, schema))
	require.Zero(t, pg.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'processed_steps'`, schema))
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
	versions, _ := embeddedVersions(t)
	require.Equal(t, len(versions), total, "exactly one instance applies each migration")
	require.True(t, tableExists(t, pg, pg.Schema))
	require.Equal(t, len(versions), pg.Count(t, `SELECT count(*) FROM justonce_migrations`))
}

func TestFilesArePlainAndPaired(t *testing.T) {
	t.Parallel()
	all, err := migrations.All()
	require.NoError(t, err)
	require.NotEmpty(t, all)
	for i, m := range all {
		// Versions increase, and may have gaps: a version can land in a
		// later release than the one after it (Up applies it then).
		require.Positive(t, m.Version)
		if i > 0 {
			require.Greater(t, m.Version, all[i-1].Version, "versions are unique and in order")
		}
		require.NotContains(t, m.Up, "{{", "no templating: golang-migrate users take the files as they are")
	}
}

// A version missing below the applied ones (released later than a newer
// one, or applied by hand and reverted) is applied by Up, and Status lists
// it as pending. The steps table (version 4) exists after Up.
func TestUpAppliesAVersionBelowTheLatest(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	ctx := context.Background()
	m := migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema})
	_, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'processed_steps'`, pg.Schema))

	// The outbox's version, as though it had not been applied.
	const outbox = 2
	all, err := migrations.All()
	require.NoError(t, err)
	for _, mig := range all {
		if mig.Version == outbox {
			pg.Exec(t, mig.Down)
		}
	}
	pg.Exec(t, `DELETE FROM justonce_migrations WHERE version = $1`, outbox)
	st, err := m.Status(ctx)
	require.NoError(t, err)
	require.Equal(t, m.Latest(), st.Version)
	require.Equal(t, []int{outbox}, st.Pending)

	res, err := m.Up(ctx)
	require.NoError(t, err)
	require.Equal(t, []int{outbox}, res.Applied)
	require.Equal(t, m.Latest(), res.To)
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'outbox'`, pg.Schema))
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
