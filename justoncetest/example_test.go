package justoncetest_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/justoncetest"
)

// exampleT stands in for a test's *testing.T, which an Example has not: it
// runs the cleanups when the example ends and panics on a failure.
type exampleT struct {
	testing.TB
	cleanups []func()
}

func (t *exampleT) Helper()          {}
func (t *exampleT) Cleanup(f func()) { t.cleanups = append(t.cleanups, f) }
func (t *exampleT) Errorf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}
func (t *exampleT) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}
func (t *exampleT) done() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}

// A handler tested with the real runtime: an event delivered twice has its
// effect once. DATABASE_URL points at any Postgres (the tests set it to the
// local one).
func Example() {
	t := &exampleT{} // in a test: the test's *testing.T
	defer t.done()

	ledger := justoncetest.Ledger(t) // a schema of the test's own, dropped at its end
	ctx := context.Background()
	if _, err := ledger.Pool().Exec(ctx, `CREATE TABLE invoices (event_id text PRIMARY KEY)`); err != nil {
		log.Fatal(err)
	}
	p, err := consumer.New(consumer.Config{Ledger: ledger, Scope: "billing"},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO invoices (event_id) VALUES ($1)`, m.ID)
			return err
		})
	if err != nil {
		log.Fatal(err)
	}

	for delivery := 1; delivery <= 2; delivery++ {
		d := justoncetest.Deliver(t, p, &consumer.Message{ID: "evt-1", Value: []byte(`{"cents":1250}`)})
		fmt.Printf("delivery %d: %s\n", delivery, d.Outcome.Disposition)
	}
	rec := justoncetest.RequireProcessed(t, ledger, inbox.Key{Scope: "billing", ID: "evt-1"})
	justoncetest.RequireDuplicate(t, ledger, inbox.Request{Key: inbox.Key{Scope: "billing", ID: "evt-1"}})
	justoncetest.RequireNotProcessed(t, ledger, inbox.Key{Scope: "billing", ID: "evt-2"})
	fmt.Println("ledger:", rec.Status)
	// Output:
	// delivery 1: executed
	// delivery 2: duplicate
	// ledger: done
}

// A message whose handler keeps failing is dead-lettered after MaxAttempts
// and recorded failed; later deliveries do not run the handler.
func ExampleRequireFailed() {
	t := &exampleT{} // in a test: the test's *testing.T
	defer t.done()

	ledger := justoncetest.Ledger(t)
	p, err := consumer.New(consumer.Config{
		Ledger:      ledger,
		Scope:       "billing",
		MaxAttempts: 3,
		Backoff:     backoff.Backoff{Initial: time.Millisecond, Max: time.Millisecond},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return errors.New("card declined")
	})
	if err != nil {
		log.Fatal(err)
	}

	d := justoncetest.Deliver(t, p, &consumer.Message{ID: "evt-9"})
	rec := justoncetest.RequireFailed(t, ledger, inbox.Key{Scope: "billing", ID: "evt-9"})
	fmt.Printf("dead-lettered: %v, attempts: %d, error: %s\n", d.DeadLettered, rec.Attempts, rec.Error)
	// Output:
	// dead-lettered: true, attempts: 3, error: card declined
}
