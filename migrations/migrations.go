// Package migrations holds the justonce schema as embedded, numbered SQL
// files and a small migrator that applies them.
//
// The files are plain SQL with unqualified table names, named
// NNN_name.up.sql and NNN_name.down.sql, so a golang-migrate user can take
// them as they are (see FS). The Migrator applies them into a configurable
// schema by setting search_path for the migration transaction, records the
// applied versions in a justonce_migrations table in that schema, and holds a
// Postgres advisory lock for the whole run so that several instances may
// migrate at once at startup: one applies, the others wait and find nothing
// left to do.
//
// Versions increase but need not be consecutive. Up applies every embedded
// version not applied yet, in order, also one below the newest applied: a
// version released after a newer one is applied by the next Up, and Status
// lists it as pending until then. (golang-migrate, which keeps only the
// newest version applied, would not apply such a version.)
//
//	m := migrations.New(pool, migrations.Config{Schema: "justonce"})
//	res, err := m.Up(ctx)
package migrations

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// FS holds the migration files, NNN_name.up.sql and NNN_name.down.sql.
//
//go:embed *.sql
var FS embed.FS

// ErrUnknownVersion is returned when a target version does not exist, or when
// the database records a version newer than this build knows.
var ErrUnknownVersion = errors.New("justonce/migrations: unknown version")

// Migration is one numbered step with its up and down SQL.
type Migration struct {
	Version int
	Name    string
	Up      string
	Down    string
}

// Config configures a Migrator.
type Config struct {
	// Schema to migrate. Empty means the connection's current schema
	// (the first entry of its search_path). Up creates it if missing.
	// Names with $, and names with non-ASCII characters longer than 47
	// bytes, are refused.
	Schema string
	// Layout of processed_events. LayoutTimeBuckets converts a plain
	// table (copying its live rows) when Up reaches the latest version;
	// once converted, a schema stays so (Down, then Up, to go back).
	Layout Layout
	// MaxTTL is the longest TTL a time-bucket ledger accepts. Default 24h.
	MaxTTL time.Duration
	// BucketWidth is how long a shard writes into one bucket before the
	// janitor opens its next, whole seconds. Default MaxTTL: a claim then
	// looks its key up in two buckets, and the table holds between one
	// and two MaxTTL of rows per shard (1.5 on average). A width of
	// 2 × MaxTTL halves the time with two buckets to look in (one and a
	// half on average) for a table a third larger.
	BucketWidth time.Duration
	// Shards is how many shards keys are spread over (1 to 1024). Default
	// DefaultShards (8). The table's size swings by about
	// ±1/(Shards × (1 + 2 × MaxTTL/BucketWidth)) around its mean (±4.2 %
	// with the defaults); a ledger has two buckets per shard most of the
	// time. Do's and DoEach's statements name their shard's buckets: three
	// to five texts per shard in each connection's statement cache (pgx's
	// holds 512 by default). Past about 100 shards, raise the pool's
	// StatementCacheCapacity, or claims prepare their statements again.
	Shards int
}

// Migrator applies the embedded migrations to one schema.
type Migrator struct {
	pool       *pgxpool.Pool
	schema     string
	cfg        Config
	migrations []Migration
}

// Result reports what a Migrate call did.
type Result struct {
	// From and To are the schema versions before and after the call.
	From, To int
	// Applied lists the versions applied (in order), up or down.
	Applied []int
}

// Status reports the schema version and what is pending.
type Status struct {
	Version int   // highest applied version, 0 when none
	Latest  int   // highest version this build knows
	Pending []int // versions not yet applied
}

// New returns a Migrator for the pool.
func New(pool *pgxpool.Pool, cfg Config) *Migrator {
	ms, err := All()
	if err != nil {
		// The files are embedded at build time and checked by tests.
		panic(err)
	}
	return &Migrator{pool: pool, schema: cfg.Schema, cfg: cfg, migrations: ms}
}

var fileRe = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.(up|down)\.sql$`)

// All returns the embedded migrations in version order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(FS, ".")
	if err != nil {
		return nil, err
	}
	byVersion := map[int]*Migration{}
	for _, e := range entries {
		m := fileRe.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("justonce/migrations: unexpected file %q", e.Name())
		}
		v, _ := strconv.Atoi(m[1])
		body, err := fs.ReadFile(FS, e.Name())
		if err != nil {
			return nil, err
		}
		mig := byVersion[v]
		if mig == nil {
			mig = &Migration{Version: v, Name: m[2]}
			byVersion[v] = mig
		}
		if m[3] == "up" {
			mig.Up = string(body)
		} else {
			mig.Down = string(body)
		}
	}
	out := make([]Migration, 0, len(byVersion))
	for _, m := range byVersion {
		if m.Up == "" || m.Down == "" {
			return nil, fmt.Errorf("justonce/migrations: version %d lacks its up or down file", m.Version)
		}
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// Latest is the highest version this build knows.
func (m *Migrator) Latest() int {
	return m.migrations[len(m.migrations)-1].Version
}

// Up applies every pending migration.
func (m *Migrator) Up(ctx context.Context) (Result, error) {
	return m.Migrate(ctx, m.Latest())
}

// Down reverts every applied migration (to version 0).
func (m *Migrator) Down(ctx context.Context) (Result, error) {
	return m.Migrate(ctx, 0)
}

// Migrate moves the schema to version target, up or down, in one
// transaction under an advisory lock: either every step applies or none does.
func (m *Migrator) Migrate(ctx context.Context, target int) (Result, error) {
	if target != 0 && m.find(target) < 0 {
		return Result{}, fmt.Errorf("%w: target %d", ErrUnknownVersion, target)
	}
	if m.cfg.Layout == LayoutTimeBuckets {
		if err := m.cfg.bucketDefaults(); err != nil {
			return Result{}, err
		}
	}
	var res Result
	err := m.inLockedTx(ctx, func(tx pgx.Tx, schema string) error {
		applied, err := appliedVersions(ctx, tx)
		if err != nil {
			return err
		}
		res.From = maxVersion(applied)
		if res.From > m.Latest() {
			return fmt.Errorf("%w: database is at %d, this build knows up to %d", ErrUnknownVersion, res.From, m.Latest())
		}
		if target >= res.From {
			for _, mig := range m.migrations {
				if mig.Version > target || applied[mig.Version] {
					continue
				}
				if _, err := tx.Exec(ctx, mig.Up); err != nil {
					return fmt.Errorf("justonce/migrations: up %03d_%s: %w", mig.Version, mig.Name, err)
				}
				if _, err := tx.Exec(ctx, `INSERT INTO justonce_migrations (version, name) VALUES ($1, $2)`, mig.Version, mig.Name); err != nil {
					return err
				}
				res.Applied = append(res.Applied, mig.Version)
			}
			if target == m.Latest() {
				if err := m.applyLayout(ctx, tx, schema); err != nil {
					return err
				}
			}
		} else {
			for i := len(m.migrations) - 1; i >= 0; i-- {
				mig := m.migrations[i]
				if mig.Version <= target || !applied[mig.Version] {
					continue
				}
				if _, err := tx.Exec(ctx, mig.Down); err != nil {
					return fmt.Errorf("justonce/migrations: down %03d_%s: %w", mig.Version, mig.Name, err)
				}
				if _, err := tx.Exec(ctx, `DELETE FROM justonce_migrations WHERE version = $1`, mig.Version); err != nil {
					return err
				}
				res.Applied = append(res.Applied, mig.Version)
			}
		}
		res.To = target
		return nil
	})
	if err != nil {
		return Result{}, err
	}
	return res, nil
}

// Status reports the applied version and the pending ones. It only reads:
// it works on a read-only connection (a replica) and creates nothing (a
// schema that does not exist is at version 0). A database newer than this
// build returns ErrUnknownVersion with the Status filled in.
func (m *Migrator) Status(ctx context.Context) (Status, error) {
	st := Status{Latest: m.Latest()}
	err := pgx.BeginTxFunc(ctx, m.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted, AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		schema, err := m.schemaName(ctx, tx)
		if err != nil {
			return err
		}
		var exists bool
		if err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`,
			pgx.Identifier{schema, "justonce_migrations"}.Sanitize()).Scan(&exists); err != nil {
			return fmt.Errorf("justonce/migrations: version table: %w", err)
		}
		applied := map[int]bool{}
		if exists {
			if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+pgx.Identifier{schema}.Sanitize()); err != nil {
				return err
			}
			if applied, err = appliedVersions(ctx, tx); err != nil {
				return err
			}
		}
		st.Version = maxVersion(applied)
		for _, mig := range m.migrations {
			if !applied[mig.Version] {
				st.Pending = append(st.Pending, mig.Version)
			}
		}
		return nil
	})
	if err != nil {
		return Status{}, err
	}
	if st.Version > st.Latest {
		return st, fmt.Errorf("%w: database is at %d, this build knows up to %d", ErrUnknownVersion, st.Version, st.Latest)
	}
	return st, nil
}

// checkSchemaName refuses the schema names the migrations cannot serve.
func checkSchemaName(schema string) error {
	if strings.Contains(schema, "$") {
		// The name is written into function bodies quoted with dollar
		// tags.
		return fmt.Errorf("justonce/migrations: schema name %q: a name with $ is not supported", schema)
	}
	// The outbox's NOTIFY channel is "justonce_outbox." + schema, cut to
	// 63 characters in SQL and 63 bytes in Go (outbox.Channel); Postgres
	// takes at most 63 bytes. They agree for ASCII names of any length
	// and for names of at most 47 bytes.
	if len(schema) > 47 {
		for _, r := range schema {
			if r >= utf8.RuneSelf {
				return fmt.Errorf("justonce/migrations: schema name %q: a name with non-ASCII characters must be at most 47 bytes", schema)
			}
		}
	}
	return nil
}

// schemaName is the configured schema, or the connection's current one.
func (m *Migrator) schemaName(ctx context.Context, tx pgx.Tx) (string, error) {
	if m.schema != "" {
		return m.schema, nil
	}
	var schema *string
	if err := tx.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		return "", fmt.Errorf("justonce/migrations: current schema: %w", err)
	}
	if schema == nil {
		return "", errors.New("justonce/migrations: no schema configured and no schema of the search_path exists: set Config.Schema")
	}
	return *schema, nil
}

func (m *Migrator) find(v int) int {
	for i, mig := range m.migrations {
		if mig.Version == v {
			return i
		}
	}
	return -1
}

// inLockedTx runs fn in a READ COMMITTED transaction that holds the
// schema's migration advisory lock and has search_path set to the schema,
// creating the schema and the version table when they do not exist. READ
// COMMITTED whatever the server's default: a migrator that waited for the
// lock must see the versions the one before it applied.
func (m *Migrator) inLockedTx(ctx context.Context, fn func(tx pgx.Tx, schema string) error) error {
	return pgx.BeginTxFunc(ctx, m.pool, pgx.TxOptions{IsoLevel: pgx.ReadCommitted}, func(tx pgx.Tx) error {
		schema, err := m.schemaName(ctx, tx)
		if err != nil {
			return err
		}
		if err := checkSchemaName(schema); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('justonce.migrate:' || $1, 0))`, schema); err != nil {
			return fmt.Errorf("justonce/migrations: advisory lock: %w", err)
		}
		ident := pgx.Identifier{schema}.Sanitize()
		// Created only when missing: CREATE … IF NOT EXISTS needs the
		// privilege to create even when there is nothing to create.
		var haveSchema, haveTable bool
		if err := tx.QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL, to_regclass($2) IS NOT NULL`,
			ident, pgx.Identifier{schema, "justonce_migrations"}.Sanitize()).Scan(&haveSchema, &haveTable); err != nil {
			return fmt.Errorf("justonce/migrations: schema: %w", err)
		}
		if !haveSchema {
			if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+ident); err != nil {
				return fmt.Errorf("justonce/migrations: create schema: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+ident); err != nil {
			return err
		}
		if !haveTable {
			if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS justonce_migrations (
			version    integer PRIMARY KEY,
			name       text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
				return fmt.Errorf("justonce/migrations: version table: %w", err)
			}
		}
		return fn(tx, schema)
	})
}

func appliedVersions(ctx context.Context, tx pgx.Tx) (map[int]bool, error) {
	rows, err := tx.Query(ctx, `SELECT version FROM justonce_migrations`)
	if err != nil {
		return nil, err
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, err
	}
	out := make(map[int]bool, len(vs))
	for _, v := range vs {
		out[v] = true
	}
	return out, nil
}

func maxVersion(applied map[int]bool) int {
	v := 0
	for k := range applied {
		if k > v {
			v = k
		}
	}
	return v
}
