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
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/transports/natsinbox"
)

// A billing consumer: each order event creates one invoice, in the same
// transaction as its ledger row. The publisher retried order-2 without
// Nats-Msg-Id, so the stream holds it twice; the second copy is
// acknowledged without running the handler.
//
// The same program runs on Kafka (kafkainbox's ExampleNew): only the import
// and the Config line differ.
func ExampleNew() {
	ex := setUp("order-1", "order-2", "order-2") // the events, published; a migrated schema
	defer ex.tearDown()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()

	ledger, err := inbox.New(ex.pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := ex.pool.Exec(ctx, `CREATE TABLE invoices (order_id text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	var answered atomic.Int32
	processor := consumer.Config{
		Ledger: ledger,
		Hooks: consumer.Hooks{OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
			fmt.Println(m.ID, out.Disposition)
			if answered.Add(1) == 3 {
				stop() // a clean stop: finish, acknowledge, leave
			}
		}},
	}
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
		return err
	}

	c, err := natsinbox.New(natsinbox.Config{Conn: ex.conn, Stream: ex.stream, Durable: "billing", Processor: processor}, handler)
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil { // nil after a clean stop
		log.Fatal(err)
	}

	var invoices int
	if err := ex.pool.QueryRow(context.Background(), `SELECT count(*) FROM invoices`).Scan(&invoices); err != nil {
		log.Fatal(err)
	}
	fmt.Println("invoices:", invoices)
	// Output:
	// order-1 executed
	// order-2 executed
	// order-2 duplicate
	// invoices: 2
}

// Replay the stream: what the ledger has done is skipped, only the missing
// events run.
func ExampleConsumer_Replay() {
	ex := setUp("order-1", "order-2", "order-3") // the events, published; a migrated schema
	defer ex.tearDown()
	ctx := context.Background()

	ledger, err := inbox.New(ex.pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := ex.pool.Exec(ctx, `CREATE TABLE invoices (order_id text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	// order-1 ran before (the scope is the durable's name).
	done := func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil }
	if _, err := ledger.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "billing", ID: "order-1"}}, done); err != nil {
		log.Fatal(err)
	}
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
		return err
	}
	c, err := natsinbox.New(natsinbox.Config{Conn: ex.conn, Stream: ex.stream, Durable: "billing",
		Processor: consumer.Config{Ledger: ledger}}, handler)
	if err != nil {
		log.Fatal(err)
	}

	rep, err := c.Replay(ctx, natsinbox.ReplayConfig{StartSeq: 1},
		consumer.ReplayOptions{DryRun: true}) // drop DryRun to run the missing ones
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("dry run: seen %d, skipped %d, would run %d\n", rep.Total.Seen, rep.Total.Skipped, rep.Total.Ran)
	rep, err = c.Replay(ctx, natsinbox.ReplayConfig{StartSeq: 1}, consumer.ReplayOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("replay: seen %d, skipped %d, ran %d\n", rep.Total.Seen, rep.Total.Skipped, rep.Total.Ran)
	// Output:
	// dry run: seen 3, skipped 1, would run 2
	// replay: seen 3, skipped 1, ran 2
}

// A JetStream consumer that creates one invoice per order, however often
// the order is delivered: here it is published twice, the second time
// without Nats-Msg-Id, so JetStream stores both copies.
func Example() {
	ex := setUp() // the ORDERS stream on orders.created; a migrated schema
	defer ex.tearDown()
	nc, pool, ctx := ex.conn, ex.pool, context.Background()
	js, _ := jetstream.New(nc)
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
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
		return err
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

// Batches: up to BatchSize messages already pulled run in one transaction,
// each as if in a savepoint of its own, and are acked after its commit (batching is on
// by default; BatchSize sets its bound, 1 turns it off). Here 250 orders
// are published, and 50 of them a second time without Nats-Msg-Id.
func ExampleConfig_batch() {
	ex := setUp() // the ORDERS stream on orders.created; a migrated schema
	defer ex.tearDown()
	nc, pool, ctx := ex.conn, ex.pool, context.Background()
	js, _ := jetstream.New(nc)
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
		Processor:  consumer.Config{Ledger: ledger, MaxAttempts: 5},
		Scheduling: consumer.Scheduling{BatchSize: 100},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
		return err
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
	ex := setUp() // a migrated schema
	defer ex.tearDown()
	nc, pool, ctx := ex.conn, ex.pool, context.Background()
	_, _ = pool.Exec(ctx, `CREATE TABLE invoices (order_id text NOT NULL)`)
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	c, err := natsinbox.New(natsinbox.Config{
		Conn: nc, Subject: "orders.created", Queue: "billing",
		Processor: consumer.Config{Ledger: ledger},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
		return err
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

// example is what the examples run against: an embedded NATS server with
// JetStream, the stream ORDERS on orders.created (and ORDERS_DLQ on
// orders.created.dlq), and a pool on a migrated schema of their own.
type example struct {
	conn     *nats.Conn
	stream   string
	pool     *pgxpool.Pool
	tearDown func()
}

// setUp starts the NATS server, creates the streams, publishes one message
// per ID to orders.created, in order, the ID in the event-id header, and
// finds Postgres from the environment (JUSTONCE_TEST_POSTGRES_URL;
// `make services-up` starts it and the tests read the address from
// .services.env).
func setUp(ids ...string) example {
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
	ctx := context.Background()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	for name, subject := range map[string]string{"ORDERS": "orders.created", "ORDERS_DLQ": "orders.created.dlq"} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{subject}}); err != nil {
			log.Fatal(err)
		}
	}
	for _, id := range ids {
		m := nats.NewMsg("orders.created")
		m.Header.Set("event-id", id)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			log.Fatal(err)
		}
	}

	dsn := os.Getenv("JUSTONCE_TEST_POSTGRES_URL")
	if dsn == "" {
		log.Fatal("example: set JUSTONCE_TEST_POSTGRES_URL (`make services-up` starts Postgres)")
	}
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
	return example{conn: nc, stream: "ORDERS", pool: pool, tearDown: func() {
		pool.Close()
		_, _ = admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE")
		_ = admin.Close(ctx)
		nc.Close()
		ns.Shutdown()
		ns.WaitForShutdown()
		_ = os.RemoveAll(dir)
	}}
}
