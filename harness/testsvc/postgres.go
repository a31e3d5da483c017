package testsvc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/migrations"
)

// PG is a Postgres schema of one test's own.
type PG struct {
	// Pool's connections have search_path set to Schema.
	Pool *pgxpool.Pool
	// Schema is unique to the test and dropped when it ends.
	Schema string
	// URL connects with search_path set to Schema (for subprocesses).
	URL string
}

// PGOption adjusts Postgres.
type PGOption func(*pgOpts)

type pgOpts struct {
	maxConns int32
	migrate  bool
}

// MaxConns sets the pool size (default 8).
func MaxConns(n int32) PGOption { return func(o *pgOpts) { o.maxConns = n } }

// NoMigrate leaves the schema empty.
func NoMigrate() PGOption { return func(o *pgOpts) { o.migrate = false } }

// PostgresURL returns the URL of the test Postgres server.
func PostgresURL(t testing.TB) string {
	t.Helper()
	return resolve(t, EnvPostgres, "postgres", startPostgres)
}

func startPostgres(ctx context.Context) (string, error) {
	_, dsn, err := startPostgresContainer(ctx)
	return dsn, err
}

var (
	adminMu   sync.Mutex
	adminPool = map[string]*pgxpool.Pool{}
)

func admin(t testing.TB, dsn string) *pgxpool.Pool {
	adminMu.Lock()
	defer adminMu.Unlock()
	if p, ok := adminPool[dsn]; ok {
		return p
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("testsvc: %s: %v", EnvPostgres, err)
	}
	cfg.MaxConns = 4
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = p.Ping(ctx)
	}
	if err != nil {
		t.Fatalf("testsvc: cannot reach Postgres at %s: %v ("+howTo+")", dsn, err, EnvPostgres)
	}
	adminPool[dsn] = p
	return p
}

// Postgres gives the test its own schema on the test server, migrated with
// the justonce migrations (unless NoMigrate), and a pool whose search_path
// is that schema. The schema is dropped when the test ends.
func Postgres(t testing.TB, opts ...PGOption) *PG {
	t.Helper()
	o := pgOpts{maxConns: 8, migrate: true}
	for _, f := range opts {
		f(&o)
	}
	dsn := PostgresURL(t)
	ad := admin(t, dsn)
	ctx := context.Background()

	schema := "t_" + randHex(6)
	if _, err := ad.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatalf("testsvc: create schema: %v", err)
	}
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("testsvc: %v", err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()

	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatalf("testsvc: %v", err)
	}
	cfg.MaxConns = o.maxConns
	cfg.ConnConfig.RuntimeParams["application_name"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("testsvc: pool: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		cctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// Other tests' connections may still hold locks in the shared
		// catalog; retry a few times.
		for i := 0; i < 5; i++ {
			if _, err := ad.Exec(cctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	})
	if o.migrate {
		if _, err := migrations.New(pool, migrations.Config{Schema: schema}).Up(ctx); err != nil {
			t.Fatalf("testsvc: migrate: %v", err)
		}
	}
	return &PG{Pool: pool, Schema: schema, URL: u.String()}
}

// Exec runs sql on the test's schema, failing the test on error.
func (pg *PG) Exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	if _, err := pg.Pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("testsvc: %s: %v", sql, err)
	}
}

// Count returns the result of a count query, failing the test on error.
func (pg *PG) Count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pg.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("testsvc: %s: %v", sql, err)
	}
	return n
}

// TerminateBackends kills every server connection of the test's pool
// (pg_terminate_backend; they carry the schema as application_name), as a
// dropped database connection looks to the client. It returns how many it terminated.
func (pg *PG) TerminateBackends(t testing.TB) int {
	t.Helper()
	ad := admin(t, PostgresURL(t))
	var n int
	err := ad.QueryRow(context.Background(), `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE pid <> pg_backend_pid() AND datname = current_database() AND backend_type = 'client backend'
		AND application_name = $1`, pg.Schema).Scan(&n)
	if err != nil {
		t.Fatalf("testsvc: terminate: %v", err)
	}
	return n
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Unique returns a random name with the given prefix, for topics, scopes
// and keys that must not collide between tests.
func Unique(prefix string) string { return fmt.Sprintf("%s-%s", prefix, randHex(5)) }
