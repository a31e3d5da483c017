package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// The quickstart: one event delivered twice has its effect once.
// DATABASE_URL points at any Postgres (the tests set it to the local one).
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	// Once, at startup (safe from many instances at once: advisory lock).
	if _, err := migrations.New(pool, migrations.Config{Schema: "justonce"}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	ledger, err := inbox.New(pool, inbox.Config{Schema: "justonce"})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS quickstart_payments (order_id text PRIMARY KEY, cents int)`); err != nil {
		log.Fatal(err)
	}

	eventID := fmt.Sprintf("evt-%d", time.Now().UnixNano()) // from the message, in a real consumer
	orderID, cents := "order-"+eventID, 1250
	for delivery := 1; delivery <= 2; delivery++ {
		out, err := ledger.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "payments", ID: eventID}},
			func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				// Your writes: they commit with the ledger row, or not at all.
				_, err := tx.Exec(ctx, `INSERT INTO quickstart_payments (order_id, cents) VALUES ($1, $2)`, orderID, cents)
				return inbox.Result{}, err
			})
		switch {
		case err != nil: // handler error or database trouble: nothing recorded, retry is safe
			log.Fatal(err)
		case out.Disposition == inbox.Executed: // ran now
		case out.Disposition == inbox.Duplicate: // ran before; out.Result is what it returned
		case out.Disposition == inbox.InFlight: // another caller holds the key right now: retry later
		case out.Disposition == inbox.Mismatch: // same key, different request fingerprint
		}
		fmt.Printf("delivery %d: %s\n", delivery, out.Disposition)
	}
	// Output:
	// delivery 1: executed
	// delivery 2: duplicate
}

// A payment whose work spans Postgres and a payment provider: an order
// row (a Postgres step, exactly once), a charge at the provider (an
// outside call with a key of its own, which the provider deduplicates on)
// and a receipt. The first attempt fails at the receipt; the second
// resumes after the recorded steps: the order and the charge do not run
// again.
func ExampleLedger_DoSteps() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrations.New(pool, migrations.Config{Schema: "justonce"}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	ledger, err := inbox.New(pool, inbox.Config{Schema: "justonce"})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS example_orders (id text PRIMARY KEY, cents int)`); err != nil {
		log.Fatal(err)
	}

	// The provider: it charges once per idempotency key.
	charges := map[string]string{}
	charge := func(key string) string {
		if _, ok := charges[key]; !ok {
			charges[key] = fmt.Sprintf("ch_%d", len(charges)+1)
		}
		return charges[key]
	}
	mailerUp := false

	paymentID := fmt.Sprintf("pay-%d", time.Now().UnixNano()) // from the request or message
	pay := func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		_, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO example_orders (id, cents) VALUES ($1, 1250)`, paymentID)
			return nil, err
		})
		if err != nil {
			return inbox.Result{}, err
		}
		chargeID, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			return []byte(charge(key)), nil // key: the provider's Idempotency-Key
		})
		if err != nil {
			return inbox.Result{}, err
		}
		_, err = s.Call(ctx, "receipt", func(ctx context.Context, key string) ([]byte, error) {
			if !mailerUp {
				return nil, errors.New("mailer down") // retryable: the steps so far stay
			}
			return nil, nil
		})
		if err != nil {
			return inbox.Result{}, err
		}
		return inbox.Result{Code: 201, Body: chargeID}, nil
	}

	req := inbox.Request{Key: inbox.Key{Scope: "payments", ID: paymentID}}
	for attempt := 1; attempt <= 3; attempt++ {
		out, err := ledger.DoSteps(ctx, req, 0, pay)
		if err != nil {
			steps, _ := ledger.Steps(ctx, req.Key)
			fmt.Printf("attempt %d: %v; %d steps recorded\n", attempt, err, len(steps))
			mailerUp = true
			continue
		}
		fmt.Printf("attempt %d: %s %s; charges at the provider: %d\n", attempt, out.Disposition, out.Result.Body, len(charges))
	}
	// Output:
	// attempt 1: mailer down; 2 steps recorded
	// attempt 2: executed ch_1; charges at the provider: 1
	// attempt 3: duplicate ch_1; charges at the provider: 1
}

// A permanent failure after a step that had an outside effect: the
// declared compensation undoes it, once, with a key of its own, and the
// key is recorded failed.
func ExampleSteps_Compensate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrations.New(pool, migrations.Config{Schema: "justonce"}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	ledger, err := inbox.New(pool, inbox.Config{Schema: "justonce"})
	if err != nil {
		log.Fatal(err)
	}

	// The provider: it charges, and refunds, once per idempotency key.
	charges, refunds := map[string]string{}, map[string]string{}
	errOutOfStock := errors.New("out of stock")

	paymentID := fmt.Sprintf("pay-%d", time.Now().UnixNano()) // from the request or message
	pay := func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		s.Compensate("charge", func(ctx context.Context, key string, charge []byte) error {
			refunds[key] = string(charge) // key: the refund's own idempotency key
			return nil
		})
		chargeID, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			if _, ok := charges[key]; !ok {
				charges[key] = fmt.Sprintf("ch_%d", len(charges)+1)
			}
			return []byte(charges[key]), nil
		})
		if err != nil {
			return inbox.Result{}, err
		}
		_, err = s.Call(ctx, "reserve", func(ctx context.Context, key string) ([]byte, error) {
			return nil, inbox.Permanent(errOutOfStock) // no retry cures it: compensate, fail for good
		})
		if err != nil {
			return inbox.Result{}, err
		}
		return inbox.Result{Code: 201, Body: chargeID}, nil
	}

	req := inbox.Request{Key: inbox.Key{Scope: "payments", ID: paymentID}}
	for delivery := 1; delivery <= 2; delivery++ {
		out, err := ledger.DoSteps(ctx, req, 0, pay)
		switch {
		case errors.Is(err, inbox.ErrPermanent):
			fmt.Printf("delivery %d: %v; charges %d, refunds %d\n", delivery, err, len(charges), len(refunds))
		case err != nil:
			log.Fatal(err)
		default:
			fmt.Printf("delivery %d: %s, %s\n", delivery, out.Disposition, out.Record.Status)
		}
	}
	steps, err := ledger.Steps(ctx, req.Key)
	if err != nil {
		log.Fatal(err)
	}
	for _, st := range steps {
		fmt.Printf("step %d: %s (%s)\n", st.Seq, st.Name, st.Kind)
	}
	// Output:
	// delivery 1: out of stock; charges 1, refunds 1
	// delivery 2: duplicate, failed
	// step 1: charge (call)
	// step 2: reserve (failed)
	// step 3: compensate:charge (compensate)
}
