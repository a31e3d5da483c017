package inbox_test

import (
	"context"
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
