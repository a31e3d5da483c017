package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

func noop(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil }

// poolWith connects to the test database with extra run-time parameters
// (and another user, when user is not empty).
func poolWith(t *testing.T, pg *testsvc.PG, user string, params map[string]string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(pg.URL)
	require.NoError(t, err)
	cfg.MaxConns = 10
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	if user != "" {
		cfg.ConnConfig.User = user
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// A conversion that waited for the migration lock while claims went on
// converts: a claim committed after the migration's transaction began
// writes a row expiring up to MaxTTL after that start, which the first
// buckets hold (they go no earlier than MaxTTL + width/Shards after it).
func TestConversionAfterWaitingWhileClaimsCommit(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.MaxConns(10))
	ctx := context.Background()
	l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema})
	require.NoError(t, err)
	_, err = l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "s", ID: "before"}}, noop)
	require.NoError(t, err)

	// Another instance holds the migration lock (it is starting too).
	hold, err := pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = hold.Rollback(ctx) }()
	_, err = hold.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('justonce.migrate:' || $1, 0))`, pg.Schema)
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() {
		_, err := migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema, Layout: migrations.LayoutTimeBuckets}).Up(ctx)
		errc <- err
	}()
	testsvc.Eventually(t, 30*time.Second, func() bool {
		return pg.Count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`) > 0
	}, "the conversion waits for the migration lock")
	// A claim with the default TTL (the default MaxTTL) meanwhile.
	_, err = l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "s", ID: "during"}}, noop)
	require.NoError(t, err)
	require.NoError(t, hold.Rollback(ctx))
	require.NoError(t, <-errc, "the conversion")
	require.Equal(t, 2, pg.Count(t, `SELECT count(*) FROM processed_events`), "both rows moved")
}

// Migrators racing on a server whose default isolation is REPEATABLE READ
// migrate once: the one that waited sees the versions applied before it.
func TestConcurrentMigratorsUnderRepeatableRead(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	pool := poolWith(t, pg, "", map[string]string{"default_transaction_isolation": "repeatable read"})
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = migrations.New(pool, migrations.Config{Schema: pg.Schema}).Up(context.Background())
		}()
	}
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "migrator %d", i)
	}
}

// Status only reads: it works on a read-only connection, creates no
// schema for a name that does not exist, and says when the database is
// newer than this build.
func TestStatusOnlyReads(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	ctx := context.Background()
	missing := pg.Schema + "_typo"
	st, err := migrations.New(pg.Pool, migrations.Config{Schema: missing}).Status(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, st.Version)
	require.Zero(t, pg.Count(t, `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, missing), "no schema created")

	_, err = migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema}).Up(ctx)
	require.NoError(t, err)
	ro := poolWith(t, pg, "", map[string]string{"default_transaction_read_only": "on"})
	m := migrations.New(ro, migrations.Config{Schema: pg.Schema})
	st, err = m.Status(ctx)
	require.NoError(t, err, "on a read-only connection")
	require.Equal(t, m.Latest(), st.Version)
	require.Empty(t, st.Pending)

	pg.Exec(t, fmt.Sprintf(`INSERT INTO justonce_migrations (version, name) VALUES (%d, 'future')`, m.Latest()+1))
	st, err = m.Status(ctx)
	require.ErrorIs(t, err, migrations.ErrUnknownVersion)
	require.Equal(t, m.Latest()+1, st.Version)
}

// A role that owns its schema but may not create schemas in the database
// migrates it.
func TestUpInAnOwnedSchemaNeedsNoCreateOnTheDatabase(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	ctx := context.Background()
	role := pg.Schema + "_owner"
	schema := pg.Schema + "_owned"
	pg.Exec(t, `CREATE ROLE `+pgx.Identifier{role}.Sanitize()+` LOGIN`)
	t.Cleanup(func() {
		bg := context.Background()
		_, _ = pg.Pool.Exec(bg, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		_, _ = pg.Pool.Exec(bg, `DROP ROLE IF EXISTS `+pgx.Identifier{role}.Sanitize())
	})
	pg.Exec(t, `CREATE SCHEMA `+pgx.Identifier{schema}.Sanitize()+` AUTHORIZATION `+pgx.Identifier{role}.Sanitize())
	pool := poolWith(t, pg, role, nil)
	var canCreate bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT has_database_privilege(current_database(), 'CREATE')`).Scan(&canCreate))
	require.False(t, canCreate, "the role may not create schemas")
	_, err := migrations.New(pool, migrations.Config{Schema: schema}).Up(ctx)
	require.NoError(t, err)
	_, err = migrations.New(pool, migrations.Config{Schema: schema, Layout: migrations.LayoutTimeBuckets}).Up(ctx)
	require.NoError(t, err)
}

// The time-bucket layout needs a UTF-8 database; the migration refuses
// another before changing anything, where the ledger would refuse every
// claim after it.
func TestConversionRefusesANonUTF8Database(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	ctx := context.Background()
	db := pg.Schema + "_latin1"
	pg.Exec(t, `CREATE DATABASE `+pgx.Identifier{db}.Sanitize()+` ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`)
	t.Cleanup(func() {
		_, _ = pg.Pool.Exec(context.Background(), `DROP DATABASE IF EXISTS `+pgx.Identifier{db}.Sanitize()+` WITH (FORCE)`)
	})
	cfg, err := pgxpool.ParseConfig(pg.URL)
	require.NoError(t, err)
	cfg.ConnConfig.Database = db
	delete(cfg.ConnConfig.RuntimeParams, "search_path")
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	_, err = migrations.New(pool, migrations.Config{Schema: "ledger"}).Up(ctx)
	require.NoError(t, err, "the plain layout works on LATIN1")
	_, err = migrations.New(pool, migrations.Config{Schema: "ledger", Layout: migrations.LayoutTimeBuckets}).Up(ctx)
	require.ErrorContains(t, err, "needs a UTF8 database")
	var kind string
	require.NoError(t, pool.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = 'ledger.processed_events'::regclass`).Scan(&kind))
	require.Equal(t, "r", kind, "still the plain table")
}

// A schema name with a dollar sign is refused with a clear error (the
// name is written into function bodies quoted with dollar tags).
func TestSchemaWithDollarIsRefused(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	_, err := migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema + "$fn$x"}).Up(context.Background())
	require.Error(t, err)
	require.ErrorContains(t, err, "a name with $ is not supported")
	require.False(t, errors.Is(err, migrations.ErrUnknownVersion))
}

// A long schema name with non-ASCII characters is refused: its outbox
// channel name would pass Postgres' 63 bytes, and every transaction that
// adds an outbox message would fail at COMMIT.
func TestLongNonASCIISchemaIsRefused(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	long := "ledger_" + strings.Repeat("é", 24) // 55 bytes
	_, err := migrations.New(pg.Pool, migrations.Config{Schema: long}).Up(context.Background())
	require.ErrorContains(t, err, "at most 47 bytes")
	short := pg.Schema + "_é"
	t.Cleanup(func() {
		_, _ = pg.Pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{short}.Sanitize()+` CASCADE`)
	})
	_, err = migrations.New(pg.Pool, migrations.Config{Schema: short}).Up(context.Background())
	require.NoError(t, err, "a short one is fine")
}
