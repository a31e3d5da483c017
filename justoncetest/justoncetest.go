package justoncetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// DeliverTimeout bounds one call of Deliver: every attempt, the waits
// between them and the dead-lettering.
const DeliverTimeout = 30 * time.Second

// Option adjusts Ledger.
type Option func(*options)

type options struct {
	ledger     inbox.Config
	migrations migrations.Config
	dsn        string // "": DATABASE_URL
	maxConns   int32  // 0: pgxpool's default
}

// WithConfig builds the ledger with cfg (Redis, Logger, TTLs, ...). Its
// Schema is replaced by the test's.
func WithConfig(cfg inbox.Config) Option { return func(o *options) { o.ledger = cfg } }

// WithMigrations migrates the test's schema with cfg (a time-bucket layout,
// for one). Its Schema is replaced by the test's.
func WithMigrations(cfg migrations.Config) Option { return func(o *options) { o.migrations = cfg } }

// WithDatabase connects to dsn (a URL or a keyword/value string, as pgx
// takes it) instead of DATABASE_URL: a Postgres the test may create
// schemas in.
func WithDatabase(dsn string) Option { return func(o *options) { o.dsn = dsn } }

// WithMaxConns sets the size of the ledger's pool (default pgxpool's: the
// larger of 4 and the number of CPUs). A test that holds handlers in their
// transactions while it queries needs more.
func WithMaxConns(n int32) Option { return func(o *options) { o.maxConns = n } }

// Ledger returns a ledger in a new schema on the Postgres named by
// DATABASE_URL (or WithDatabase), migrated, whose pool (Ledger.Pool) has
// its search_path set to that schema. The schema and everything in it are
// dropped, and the pool closed, when the test ends. It fails the test when
// DATABASE_URL is unset or Postgres cannot be reached.
func Ledger(t testing.TB, opts ...Option) *inbox.Ledger {
	t.Helper()
	var o options
	for _, f := range opts {
		f(&o)
	}
	dsn, from := o.dsn, "WithDatabase's connection string"
	if dsn == "" {
		dsn, from = os.Getenv("DATABASE_URL"), "DATABASE_URL"
		if dsn == "" {
			t.Fatalf("justoncetest: DATABASE_URL is not set: set it to a Postgres the test may create schemas in, such as postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable")
		}
	}
	schema := "justoncetest_" + randHex(6)
	// A URL or a keyword/value string, as pgx takes it; pgx redacts the
	// password in its parse errors.
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		t.Fatalf("justoncetest: %s: %v", from, err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if o.maxConns > 0 {
		cfg.MaxConns = o.maxConns
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("justoncetest: %s: %v", from, err)
	}
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		pool.Close()
		t.Fatalf("justoncetest: cannot create a schema on the Postgres of %s (database %q on %s): %v",
			from, cfg.ConnConfig.Database, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))), err)
	}
	t.Cleanup(func() { drop(t, pool, schema) })

	o.migrations.Schema = schema
	if _, err := migrations.New(pool, o.migrations).Up(ctx); err != nil {
		t.Fatalf("justoncetest: migrate schema %s: %v", schema, err)
	}
	o.ledger.Schema = schema
	l, err := inbox.New(pool, o.ledger)
	if err != nil {
		t.Fatalf("justoncetest: %v", err)
	}
	return l
}

// drop removes the test's schema, retrying while other sessions hold
// catalog locks, and closes the pool.
func drop(t testing.TB, pool *pgxpool.Pool, schema string) {
	defer pool.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var err error
	for range 5 {
		if _, err = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Errorf("justoncetest: drop schema %s: %v", schema, err)
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Deliver runs m through p as a front does (Processor.ProcessWithRetry:
// attempts, backoff, dead-lettering, the ledger transaction) and returns the
// final Decision: Ack, with Outcome or DeadLettered set. It fails the test
// when no decision comes within DeliverTimeout. Set a short
// consumer.Config.Backoff to dead-letter quickly.
func Deliver(t testing.TB, p *consumer.Processor, m *consumer.Message) consumer.Decision {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), DeliverTimeout)
	defer cancel()
	d := p.ProcessWithRetry(ctx, m, nil)
	if d.Action != consumer.Ack {
		t.Fatalf("justoncetest: Deliver: message %q not done within %s: %s after %d attempt(s): %v", m.ID, DeliverTimeout, d.Action, m.Attempt, d.Err)
	}
	return d
}

// RequireProcessed fails the test unless k's effect happened: its row is
// done. It returns the row (Result holds what the handler recorded).
func RequireProcessed(t testing.TB, l *inbox.Ledger, k inbox.Key) *inbox.Record {
	t.Helper()
	return requireStatus(t, "RequireProcessed", l, k, inbox.StatusDone)
}

// RequireFailed fails the test unless k was given up on: dead-lettered and
// recorded failed. It returns the row (Error says why, Attempts how often).
func RequireFailed(t testing.TB, l *inbox.Ledger, k inbox.Key) *inbox.Record {
	t.Helper()
	return requireStatus(t, "RequireFailed", l, k, inbox.StatusFailed)
}

// RequireNotProcessed fails the test when k has a live row in any status:
// it passes only when the next delivery of k would run the handler (never
// done, rolled back, released or expired).
func RequireNotProcessed(t testing.TB, l *inbox.Ledger, k inbox.Key) {
	t.Helper()
	rec, err := lookup(l, k)
	if err != nil {
		t.Fatalf("justoncetest: RequireNotProcessed: %v", err)
	}
	if rec != nil {
		t.Fatalf("justoncetest: RequireNotProcessed: key %s was found %s", fmtKey(k), describe(rec))
	}
}

// RequireDuplicate fails the test unless a delivery of req now would be
// answered Duplicate, and returns that Outcome (Record.Status says done or
// failed). It claims req as a delivery does, with the fingerprint check,
// in a transaction it rolls back: a new key is not recorded, nothing is
// changed in the table or the Redis cache. Only the ledger's Counters see
// the claim.
func RequireDuplicate(t testing.TB, l *inbox.Ledger, req inbox.Request) inbox.Outcome {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tx, err := l.Pool().Begin(ctx)
	if err != nil {
		t.Fatalf("justoncetest: RequireDuplicate: %v", err)
	}
	ran := false
	out, err := l.DoTx(ctx, tx, req, func(context.Context, pgx.Tx) (inbox.Result, error) {
		ran = true
		return inbox.Result{}, nil
	})
	_ = tx.Rollback(context.Background())
	switch {
	case err != nil:
		t.Fatalf("justoncetest: RequireDuplicate: key %s: %v", fmtKey(req.Key), err)
	case out.Disposition == inbox.Duplicate:
		return out
	case ran:
		t.Fatalf("justoncetest: RequireDuplicate: key %s is new: a delivery would run the handler", fmtKey(req.Key))
	default:
		found := "no row visible"
		if out.Record != nil {
			found = "found " + describe(out.Record)
		}
		t.Fatalf("justoncetest: RequireDuplicate: key %s: a delivery would be answered %s (%s)", fmtKey(req.Key), out.Disposition, found)
	}
	return out
}

func requireStatus(t testing.TB, name string, l *inbox.Ledger, k inbox.Key, want inbox.Status) *inbox.Record {
	t.Helper()
	rec, err := lookup(l, k)
	switch {
	case err != nil:
		t.Fatalf("justoncetest: %s: %v", name, err)
	case rec == nil:
		t.Fatalf("justoncetest: %s: key %s has no row (never done, rolled back, released or expired)", name, fmtKey(k))
	case rec.Status != want:
		t.Fatalf("justoncetest: %s: key %s was found %s", name, fmtKey(k), describe(rec))
	}
	return rec
}

// lookup returns k's live row, nil when there is none.
func lookup(l *inbox.Ledger, k inbox.Key) (*inbox.Record, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rec, err := l.Lookup(ctx, k)
	if errors.Is(err, inbox.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("key %s: %w", fmtKey(k), err)
	}
	return rec, nil
}

func fmtKey(k inbox.Key) string {
	if k.Tenant == "" {
		return fmt.Sprintf("%s/%s", k.Scope, k.ID)
	}
	return fmt.Sprintf("%s/%s/%s", k.Scope, k.Tenant, k.ID)
}

func describe(r *inbox.Record) string {
	s := fmt.Sprintf("status=%s attempts=%d", r.Status, r.Attempts)
	if r.Error != "" {
		s += fmt.Sprintf(" error=%q", r.Error)
	}
	if r.Source != "" {
		s += " source=" + string(r.Source)
	}
	if r.Status == inbox.StatusProcessing && r.LeaseOwner != "" {
		s += fmt.Sprintf(" lease owner=%s until=%s", r.LeaseOwner, r.LeaseUntil.Format(time.RFC3339))
	}
	return s
}
