package justoncetest_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/justoncetest"
)

// fakeT records what the kit reports. Fatalf ends the goroutine, as
// testing.T's does; any method the kit should not call panics (nil TB).
type fakeT struct {
	testing.TB
	mu       sync.Mutex
	errs     []string
	fatal    string
	cleanups []func()
}

func (f *fakeT) Helper() {}
func (f *fakeT) Errorf(format string, args ...any) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errs = append(f.errs, fmt.Sprintf(format, args...))
}
func (f *fakeT) Fatalf(format string, args ...any) {
	f.mu.Lock()
	f.fatal = fmt.Sprintf(format, args...)
	f.mu.Unlock()
	runtime.Goexit()
}
func (f *fakeT) Cleanup(fn func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cleanups = append(f.cleanups, fn)
}

// end runs the cleanups, last first, as a test's end does.
func (f *fakeT) end() {
	for i := len(f.cleanups) - 1; i >= 0; i-- {
		f.cleanups[i]()
	}
}

// run calls fn with a fakeT on a goroutine of its own (Fatalf ends it) and
// returns the fakeT once fn has returned or failed.
func run(fn func(tb testing.TB)) *fakeT {
	f := &fakeT{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	return f
}

// mustFail asserts that fn fails its test with a message holding every one
// of want.
func mustFail(t *testing.T, fn func(tb testing.TB), want ...string) {
	t.Helper()
	f := run(fn)
	f.end()
	if f.fatal == "" {
		t.Fatalf("the assertion passed; want a failure saying %q", want)
	}
	t.Logf("failed as it should: %s", f.fatal)
	for _, w := range want {
		if !strings.Contains(f.fatal, w) {
			t.Errorf("failure %q does not say %q", f.fatal, w)
		}
	}
}

// mustPass asserts that fn does not fail its test.
func mustPass(t *testing.T, fn func(tb testing.TB)) {
	t.Helper()
	f := run(fn)
	f.end()
	if f.fatal != "" || len(f.errs) > 0 {
		t.Fatalf("the assertion failed: %q %q", f.fatal, f.errs)
	}
}

type fixture struct {
	ledger *inbox.Ledger
	p      *consumer.Processor
	runs   map[string]int
	mu     sync.Mutex
}

// setup returns a ledger of the test's own and a processor in scope
// "billing" whose handler inserts the event into invoices and fails for IDs
// starting with "bad".
func setup(t *testing.T) *fixture {
	t.Helper()
	fx := &fixture{ledger: justoncetest.Ledger(t), runs: map[string]int{}}
	if _, err := fx.ledger.Pool().Exec(context.Background(), `CREATE TABLE invoices (event_id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New(consumer.Config{
		Ledger:      fx.ledger,
		Scope:       "billing",
		MaxAttempts: 2,
		Backoff:     backoff.Backoff{Initial: time.Millisecond, Max: time.Millisecond},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		fx.mu.Lock()
		fx.runs[m.ID]++
		fx.mu.Unlock()
		if strings.HasPrefix(m.ID, "bad") {
			return errors.New("boom")
		}
		_, err := tx.Exec(ctx, `INSERT INTO invoices (event_id) VALUES ($1)`, m.ID)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	fx.p = p
	return fx
}

func (fx *fixture) ran(id string) int {
	fx.mu.Lock()
	defer fx.mu.Unlock()
	return fx.runs[id]
}

func key(id string) inbox.Key { return inbox.Key{Scope: "billing", ID: id} }

func TestLedgerOwnSchemaDroppedAtEnd(t *testing.T) {
	var schema string
	f := run(func(tb testing.TB) {
		l := justoncetest.Ledger(tb)
		ctx := context.Background()
		if err := l.Pool().QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
			t.Error(err)
			return
		}
		if _, err := l.Pool().Exec(ctx, `CREATE TABLE mine (id int)`); err != nil {
			t.Error(err)
		}
		if _, err := l.Do(ctx, inbox.Request{Key: key("evt-1")}, func(context.Context, pgx.Tx) (inbox.Result, error) {
			return inbox.Result{}, nil
		}); err != nil {
			t.Error(err)
		}
	})
	if f.fatal != "" {
		t.Fatal(f.fatal)
	}
	if !strings.HasPrefix(schema, "justoncetest_") {
		t.Fatalf("search_path schema = %q, want the test's own", schema)
	}
	pool, err := pgxpool.New(context.Background(), os.Getenv("DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	count := func() (n int) {
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, schema).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n < 2 { // processed_events, mine, ...
		t.Fatalf("schema %s holds %d tables before the test's end", schema, n)
	}
	f.end()
	if len(f.errs) > 0 {
		t.Fatalf("cleanup: %q", f.errs)
	}
	var exists bool
	if err := pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Fatalf("schema %s still exists after the test's end", schema)
	}
}

// DATABASE_URL may be a keyword/value connection string, as pgx and libpq
// take it.
func TestLedgerWithKeywordValueDatabaseURL(t *testing.T) {
	u, err := url.Parse(os.Getenv("DATABASE_URL"))
	if err != nil {
		t.Fatal(err)
	}
	pw, _ := u.User.Password()
	kv := fmt.Sprintf("host=%s port=%s user=%s password='%s' dbname=%s sslmode=disable",
		u.Hostname(), u.Port(), u.User.Username(), pw, strings.TrimPrefix(u.Path, "/"))
	t.Setenv("DATABASE_URL", kv)
	ownSchema(t)
}

// WithDatabase names the Postgres instead of DATABASE_URL (unset here), and
// WithMaxConns sizes the pool.
func TestLedgerWithDatabaseAndMaxConns(t *testing.T) {
	dsn := os.Getenv("DATABASE_URL")
	t.Setenv("DATABASE_URL", "")
	if maxConns := ownSchema(t, justoncetest.WithDatabase(dsn), justoncetest.WithMaxConns(7)); maxConns != 7 {
		t.Fatalf("pool size %d, want 7", maxConns)
	}
}

// ownSchema runs Ledger with opts in a test that ends, checks that its pool
// used a schema of the test's own, and returns the pool's size.
func ownSchema(t *testing.T, opts ...justoncetest.Option) (maxConns int32) {
	t.Helper()
	var schema string
	f := run(func(tb testing.TB) {
		l := justoncetest.Ledger(tb, opts...)
		maxConns = l.Pool().Config().MaxConns
		if err := l.Pool().QueryRow(context.Background(), `SELECT current_schema()`).Scan(&schema); err != nil {
			t.Error(err)
		}
	})
	f.end()
	if f.fatal != "" {
		t.Fatal(f.fatal)
	}
	if !strings.HasPrefix(schema, "justoncetest_") {
		t.Fatalf("search_path schema = %q, want the test's own", schema)
	}
	return maxConns
}

func TestLedgerWithoutDatabaseURLFails(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	mustFail(t, func(tb testing.TB) { justoncetest.Ledger(tb) }, "DATABASE_URL is not set")
}

func TestLedgerUnreachableFails(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody:secret@127.0.0.1:1/none?sslmode=disable&connect_timeout=2")
	f := run(func(tb testing.TB) { justoncetest.Ledger(tb) })
	f.end()
	if !strings.Contains(f.fatal, "cannot create a schema") {
		t.Fatalf("failure %q does not say the schema could not be created", f.fatal)
	}
	if strings.Contains(f.fatal, "secret") {
		t.Fatalf("failure %q shows the password", f.fatal)
	}
}

func TestProcessed(t *testing.T) {
	fx := setup(t)
	m := func() *consumer.Message { return &consumer.Message{ID: "evt-1"} }
	if d := justoncetest.Deliver(t, fx.p, m()); d.Outcome.Disposition != inbox.Executed {
		t.Fatalf("first delivery: %+v", d)
	}
	if d := justoncetest.Deliver(t, fx.p, m()); d.Outcome.Disposition != inbox.Duplicate {
		t.Fatalf("redelivery: %+v", d)
	}
	if n := fx.ran("evt-1"); n != 1 {
		t.Fatalf("handler ran %d times", n)
	}
	mustPass(t, func(tb testing.TB) { justoncetest.RequireProcessed(tb, fx.ledger, key("evt-1")) })
	mustPass(t, func(tb testing.TB) {
		out := justoncetest.RequireDuplicate(tb, fx.ledger, inbox.Request{Key: key("evt-1")})
		if out.Record == nil || out.Record.Status != inbox.StatusDone {
			t.Errorf("RequireDuplicate returned %+v", out)
		}
	})
	mustFail(t, func(tb testing.TB) { justoncetest.RequireNotProcessed(tb, fx.ledger, key("evt-1")) },
		"RequireNotProcessed", "billing/evt-1", "status=done", "attempts=")
	mustFail(t, func(tb testing.TB) { justoncetest.RequireFailed(tb, fx.ledger, key("evt-1")) },
		"RequireFailed", "billing/evt-1", "status=done")
}

func TestFailed(t *testing.T) {
	fx := setup(t)
	d := justoncetest.Deliver(t, fx.p, &consumer.Message{ID: "bad-1"})
	if !d.DeadLettered || d.Action != consumer.Ack {
		t.Fatalf("delivery: %+v", d)
	}
	mustPass(t, func(tb testing.TB) {
		rec := justoncetest.RequireFailed(tb, fx.ledger, key("bad-1"))
		if rec.Attempts != 2 || rec.Error != "boom" {
			t.Errorf("RequireFailed returned attempts=%d error=%q", rec.Attempts, rec.Error)
		}
	})
	mustFail(t, func(tb testing.TB) { justoncetest.RequireProcessed(tb, fx.ledger, key("bad-1")) },
		"RequireProcessed", "billing/bad-1", "status=failed", "attempts=2", `error="boom"`)
	mustFail(t, func(tb testing.TB) { justoncetest.RequireNotProcessed(tb, fx.ledger, key("bad-1")) },
		"status=failed", "attempts=2")
	// A failed key is a duplicate: the next delivery does not run the handler.
	mustPass(t, func(tb testing.TB) {
		out := justoncetest.RequireDuplicate(tb, fx.ledger, inbox.Request{Key: key("bad-1")})
		if out.Record == nil || out.Record.Status != inbox.StatusFailed {
			t.Errorf("RequireDuplicate returned %+v", out)
		}
	})
	justoncetest.Deliver(t, fx.p, &consumer.Message{ID: "bad-1"})
	if n := fx.ran("bad-1"); n != 2 {
		t.Fatalf("handler ran %d times, want 2 (the redelivery of a failed key must not run it)", n)
	}
}

// A new key: RequireDuplicate fails and leaves nothing behind, so the next
// delivery still runs the handler.
func TestNewKeyDuplicateHasNoSideEffect(t *testing.T) {
	fx := setup(t)
	mustPass(t, func(tb testing.TB) { justoncetest.RequireNotProcessed(tb, fx.ledger, key("evt-2")) })
	mustFail(t, func(tb testing.TB) { justoncetest.RequireProcessed(tb, fx.ledger, key("evt-2")) },
		"RequireProcessed", "billing/evt-2", "no row")
	mustFail(t, func(tb testing.TB) { justoncetest.RequireFailed(tb, fx.ledger, key("evt-2")) },
		"RequireFailed", "no row")
	mustFail(t, func(tb testing.TB) {
		justoncetest.RequireDuplicate(tb, fx.ledger, inbox.Request{Key: key("evt-2")})
	}, "RequireDuplicate", "billing/evt-2", "is new")
	mustPass(t, func(tb testing.TB) { justoncetest.RequireNotProcessed(tb, fx.ledger, key("evt-2")) })
	if d := justoncetest.Deliver(t, fx.p, &consumer.Message{ID: "evt-2"}); d.Outcome.Disposition != inbox.Executed {
		t.Fatalf("delivery after RequireDuplicate: %+v", d)
	}
	if n := fx.ran("evt-2"); n != 1 {
		t.Fatalf("handler ran %d times", n)
	}
}

func TestDuplicateMismatchAndInFlight(t *testing.T) {
	fx := setup(t)
	ctx := context.Background()
	req := inbox.Request{Key: key("pay-1"), Fingerprint: []byte("body-a")}
	if _, err := fx.ledger.Do(ctx, req, func(context.Context, pgx.Tx) (inbox.Result, error) {
		return inbox.Result{}, nil
	}); err != nil {
		t.Fatal(err)
	}
	mustPass(t, func(tb testing.TB) { justoncetest.RequireDuplicate(tb, fx.ledger, req) })
	other := req
	other.Fingerprint = []byte("body-b")
	mustFail(t, func(tb testing.TB) { justoncetest.RequireDuplicate(tb, fx.ledger, other) },
		"billing/pay-1", "mismatch", "status=done")

	lease, _, err := fx.ledger.AcquireLease(ctx, inbox.Request{Key: key("pay-2")}, time.Minute)
	if err != nil || lease == nil {
		t.Fatalf("AcquireLease: %v %v", lease, err)
	}
	defer func() { _ = lease.Abandon(ctx) }()
	mustFail(t, func(tb testing.TB) { justoncetest.RequireDuplicate(tb, fx.ledger, inbox.Request{Key: key("pay-2")}) },
		"billing/pay-2", inbox.InFlight.String())
	mustFail(t, func(tb testing.TB) { justoncetest.RequireProcessed(tb, fx.ledger, key("pay-2")) },
		"status=processing", "lease owner=")
}
