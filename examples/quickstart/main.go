// Command quickstart shows the justonce ledger end to end on a real
// Postgres: it migrates a schema, delivers the same "order paid" event five
// times (three of them at once), and shows that the business effect
// happened once.
//
//	make services-up                 # Postgres, Redis, Kafka on loopback
//	go run ./examples/quickstart     # or: DATABASE_URL=postgres://... go run ./examples/quickstart
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := run(ctx); err != nil {
		log.Fatal(err)
	}
}

func databaseURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	// The address `make services-up` wrote to .services.env (make demo
	// exports it).
	if u := os.Getenv("JUSTONCE_TEST_POSTGRES_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:55432/postgres?sslmode=disable"
}

func run(ctx context.Context) error {
	const schema = "justonce_quickstart"
	cfg, err := pgxpool.ParseConfig(databaseURL())
	if err != nil {
		return err
	}
	// The business table lives next to the ledger in this example.
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()

	// 1. Migrate: creates processed_events in the schema (safe to run from
	//    every instance at startup).
	if _, err := migrations.New(pool, migrations.Config{Schema: schema}).Up(ctx); err != nil {
		return fmt.Errorf("migrate (is Postgres running? try `make services-up`): %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS order_payments (event_id text, order_id text, amount_cents int)`); err != nil {
		return err
	}
	eventID := fmt.Sprintf("order-42-paid-%d", time.Now().UnixNano())

	// 2. The ledger.
	ledger, err := inbox.New(pool, inbox.Config{Schema: schema})
	if err != nil {
		return err
	}

	// 3. The handler: its writes commit together with the ledger row.
	handle := func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO order_payments (event_id, order_id, amount_cents) VALUES ($1, 'order-42', 1999)`, eventID)
		return inbox.Result{Code: 201, Body: []byte(`{"order":"order-42","status":"paid"}`)}, err
	}
	req := inbox.Request{Key: inbox.Key{Scope: "payments", ID: eventID}, Source: "kafka"}

	// 4. Deliver the event five times: three at once, then two redeliveries.
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := 1; i <= 3; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := ledger.Do(ctx, req, handle)
			mu.Lock()
			defer mu.Unlock()
			report(i, out, err)
		}()
	}
	wg.Wait()
	for i := 4; i <= 5; i++ {
		out, err := ledger.Do(ctx, req, handle)
		report(i, out, err)
	}

	var payments int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM order_payments WHERE event_id = $1`, eventID).Scan(&payments); err != nil {
		return err
	}
	rec, err := ledger.Lookup(ctx, req.Key)
	if err != nil {
		return err
	}
	fmt.Printf("\n5 deliveries of event %s -> %d payment row(s)\n", inbox.Mask(eventID), payments)
	fmt.Printf("ledger row: status=%s source=%s result=%d %s expires=%s\n",
		rec.Status, rec.Source, rec.Result.Code, rec.Result.Body, rec.ExpiresAt.Format(time.RFC3339))
	if payments != 1 {
		return fmt.Errorf("expected exactly one payment, got %d", payments)
	}
	return nil
}

func report(i int, out inbox.Outcome, err error) {
	if err != nil {
		fmt.Printf("delivery %d: error: %v\n", i, err)
		return
	}
	fmt.Printf("delivery %d: %-9s", i, out.Disposition)
	if out.Disposition == inbox.Duplicate {
		fmt.Printf(" replayed result: %d %s", out.Result.Code, out.Result.Body)
	}
	if out.Disposition == inbox.InFlight {
		fmt.Printf(" (another delivery holds the key right now; retry later)")
	}
	fmt.Println()
}
