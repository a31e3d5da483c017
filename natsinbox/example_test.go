package natsinbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/natsinbox"
)

// A JetStream consumer that creates one invoice per order, however often
// the order is delivered: here it is published twice, the second time
// without Nats-Msg-Id, so JetStream stores both copies.
func Example() {
	nc, pool, cleanup := exampleServices()
	defer cleanup()
	ctx := context.Background()

	js, _ := jetstream.New(nc)
	_, _ = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.created"}})
	_, _ = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS_DLQ", Subjects: []string{"orders.created.dlq"}})
	_, _ = pool.Exec(ctx, `CREATE TABLE invoices (order_id text NOT NULL)`)
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}

	c, err := natsinbox.New(natsinbox.Config{
		Conn:      nc,
		Stream:    "ORDERS",
		Durable:   "billing", // also the ledger scope
		Processor: consumer.Config{Ledger: ledger},
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
			return err
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()

	first := nats.NewMsg("orders.created")
	first.Header.Set(jetstream.MsgIDHeader, "order-42")
	_, _ = js.PublishMsg(ctx, first)
	again := nats.NewMsg("orders.created")
	again.Header.Set("ce-id", "order-42") // same event, no JetStream dedupe
	_, _ = js.PublishMsg(ctx, again)

	// Wait until both copies are acked, then shut down (drain).
	waitAcked(js, "ORDERS", "billing", 2)
	stop()
	<-done

	var n int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&n)
	fmt.Println("deliveries: 2, invoices:", n)
	// Output: deliveries: 2, invoices: 1
}

// Batch mode: up to 100 messages per Fetch are claimed in one statement,
// run in one transaction and acked after its commit. Here 250 orders are
// published, and 50 of them a second time without Nats-Msg-Id.
func ExampleConfig_batch() {
	nc, pool, cleanup := exampleServices()
	defer cleanup()
	ctx := context.Background()
	js, _ := jetstream.New(nc)
	_, _ = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.created"}})
	_, _ = js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS_DLQ", Subjects: []string{"orders.created.dlq"}})
	_, _ = pool.Exec(ctx, `CREATE TABLE invoices (order_id text NOT NULL)`)
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	for i := 0; i < 250; i++ {
		m := nats.NewMsg("orders.created")
		m.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("order-%d", i))
		if _, err := js.PublishMsg(ctx, m); err != nil {
			log.Fatal(err)
		}
	}
	for i := 0; i < 250; i += 5 {
		m := nats.NewMsg("orders.created")
		m.Header.Set("ce-id", fmt.Sprintf("order-%d", i)) // the same event again
		if _, err := js.PublishMsg(ctx, m); err != nil {
			log.Fatal(err)
		}
	}

	c, err := natsinbox.New(natsinbox.Config{
		Conn: nc, Stream: "ORDERS", Durable: "billing",
		Processor: consumer.Config{Ledger: ledger, MaxAttempts: 5},
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
			return err
		},
		Batch: 100,
	})
	if err != nil {
		log.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()
	waitAcked(js, "ORDERS", "billing", 300)
	stop()
	<-done

	var n int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&n)
	fmt.Println("messages: 300, invoices:", n)
	// Output: messages: 300, invoices: 250
}

// Core NATS without JetStream: members of the "billing" queue group share
// orders.created. A failed handler is retried in place, then the message
// goes to orders.created.dlq; a crash loses the message in flight, because
// core NATS does not redeliver. A publisher that sends an event again (here
// until it sees the invoices) does not run it twice.
func ExampleConfig_core() {
	nc, pool, cleanup := exampleServices()
	defer cleanup()
	ctx := context.Background()
	_, _ = pool.Exec(ctx, `CREATE TABLE invoices (order_id text NOT NULL)`)
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	c, err := natsinbox.New(natsinbox.Config{
		Conn: nc, Subject: "orders.created", Queue: "billing",
		Processor: consumer.Config{Ledger: ledger},
		Handler: func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
			return err
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(runCtx) }()

	// Core NATS keeps nothing for a subscriber that is not there yet: the
	// publisher sends the three orders again until they are invoiced.
	var n int
	for deadline := time.Now().Add(30 * time.Second); n < 3 && time.Now().Before(deadline); {
		for _, id := range []string{"order-1", "order-2", "order-3"} {
			m := nats.NewMsg("orders.created")
			m.Header.Set(jetstream.MsgIDHeader, id)
			_ = nc.PublishMsg(m)
		}
		_ = nc.Flush()
		time.Sleep(50 * time.Millisecond)
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&n)
	}
	stop()
	<-done // handles what was received before returning

	_ = pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&n)
	fmt.Println("invoices:", n)
	// Output: invoices: 3
}

// waitAcked waits until the durable has acked n messages and has none
// pending.
func waitAcked(js jetstream.JetStream, stream, durable string, n uint64) {
	ctx := context.Background()
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
		cons, err := js.Consumer(ctx, stream, durable)
		if err == nil {
			if info, err := cons.Info(ctx); err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.Delivered.Stream == n {
				return
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	log.Fatalf("%s/%s: %d messages not acked within 30s", stream, durable, n)
}

// exampleServices starts an embedded NATS server with JetStream and gives
// the example its own Postgres schema, migrated, on the test Postgres
// (JUSTONCE_TEST_POSTGRES_URL or .services.env).
func exampleServices() (*nats.Conn, *pgxpool.Pool, func()) {
	dir, err := os.MkdirTemp("", "natsinbox-example")
	if err != nil {
		log.Fatal(err)
	}
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true,
		StoreDir: filepath.Join(dir, "js"), NoLog: true, NoSigs: true})
	if err != nil {
		log.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		log.Fatal("nats-server not ready")
	}
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		log.Fatal(err)
	}

	dsn := testsvc.Getenv(testsvc.EnvPostgres)
	if dsn == "" {
		log.Fatalf("example needs Postgres: set %s (or run `make services-up`)", testsvc.EnvPostgres)
	}
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, dsn)
	if err != nil {
		log.Fatal(err)
	}
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	schema := "example_" + hex.EncodeToString(b)
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		log.Fatal(err)
	}
	u, _ := url.Parse(dsn)
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	pool, err := pgxpool.New(ctx, u.String())
	if err != nil {
		log.Fatal(err)
	}
	if _, err := migrations.New(pool, migrations.Config{Schema: schema}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	return nc, pool, func() {
		pool.Close()
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		_ = admin.Close(ctx)
		nc.Close()
		ns.Shutdown()
		ns.WaitForShutdown()
		_ = os.RemoveAll(dir)
	}
}
