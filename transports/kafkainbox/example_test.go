package kafkainbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// A billing consumer: each order event creates one invoice, in the same
// transaction as its ledger row. The producer retried order-2, so Kafka
// holds it twice; the second copy is acknowledged without running the
// handler.
//
// The same program runs on NATS (natsinbox's ExampleNew): only the import
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

	c, err := kafkainbox.New(kafkainbox.Config{Brokers: ex.brokers, Topic: ex.topic, GroupID: ex.group, Processor: processor}, handler)
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

// Replay the topic from a time: what the ledger has done is skipped, only
// the missing events run. A replay joins no group and commits no offset.
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
	// order-1 ran before, in the consumer's scope.
	done := func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil }
	if _, err := ledger.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "billing", ID: "order-1"}}, done); err != nil {
		log.Fatal(err)
	}
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
		return err
	}
	c, err := kafkainbox.New(kafkainbox.Config{Brokers: ex.brokers, Topic: ex.topic, GroupID: ex.group,
		Processor: consumer.Config{Ledger: ledger, Scope: "billing"}}, handler)
	if err != nil {
		log.Fatal(err)
	}

	since := kafkainbox.ReplayConfig{StartTime: time.Now().Add(-24 * time.Hour)}
	rep, err := c.Replay(ctx, since, consumer.ReplayOptions{DryRun: true}) // drop DryRun to run the missing ones
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("dry run: seen %d, skipped %d, would run %d\n", rep.Total.Seen, rep.Total.Skipped, rep.Total.Ran)
	rep, err = c.Replay(ctx, since, consumer.ReplayOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("replay: seen %d, skipped %d, ran %d\n", rep.Total.Seen, rep.Total.Skipped, rep.Total.Ran)
	// Output:
	// dry run: seen 3, skipped 1, would run 2
	// replay: seen 3, skipped 1, ran 2
}

func ExampleNewMessage() {
	m := kafkainbox.NewMessage("order-42", []byte("customer-7"), []byte(`{"total": 10}`))
	fmt.Printf("%s=%s key=%s\n", m.Headers[0].Key, m.Headers[0].Value, m.Key)
	// Output: event-id=order-42 key=customer-7
}

// example is what the examples run against: a topic of their own, with the
// events published, a consumer group name, and a pool on a migrated schema
// of their own.
type example struct {
	brokers      []string
	topic, group string
	pool         *pgxpool.Pool
	tearDown     func()
}

// setUp finds Kafka and Postgres from the environment
// (JUSTONCE_TEST_KAFKA_BROKERS, a comma-separated list, and
// JUSTONCE_TEST_POSTGRES_URL; `make services-up` starts both and the tests
// read the addresses from .services.env), creates a one-partition topic and
// publishes one message per ID to it, in order, the ID in the event-id
// header.
func setUp(ids ...string) example {
	ctx := context.Background()
	pgURL, kafkaAddr := os.Getenv("JUSTONCE_TEST_POSTGRES_URL"), os.Getenv("JUSTONCE_TEST_KAFKA_BROKERS")
	if pgURL == "" || kafkaAddr == "" {
		log.Fatal("example: set JUSTONCE_TEST_POSTGRES_URL and JUSTONCE_TEST_KAFKA_BROKERS (`make services-up` starts both)")
	}
	ex := example{brokers: strings.Split(kafkaAddr, ",")}
	suffix := make([]byte, 5)
	_, _ = rand.Read(suffix)
	name := "ex_" + hex.EncodeToString(suffix)
	ex.topic = strings.ReplaceAll(name, "_", "-")
	ex.group = "billing-" + ex.topic

	conn, err := kafka.Dial("tcp", ex.brokers[0])
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ctrl, err := conn.Controller()
	if err != nil {
		log.Fatal(err)
	}
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	if err != nil {
		log.Fatal(err)
	}
	defer cc.Close()
	if err := cc.CreateTopics(kafka.TopicConfig{Topic: ex.topic, NumPartitions: 1, ReplicationFactor: 1}); err != nil {
		log.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if ps, err := conn.ReadPartitions(ex.topic); err == nil && len(ps) == 1 && ps[0].Leader.Host != "" {
			break
		}
		if time.Now().After(deadline) {
			log.Fatal("example: topic has no leader")
		}
	}
	w := &kafka.Writer{Addr: kafka.TCP(ex.brokers...), Topic: ex.topic, RequiredAcks: kafka.RequireAll, Transport: &kafka.Transport{}}
	for _, id := range ids {
		if err := w.WriteMessages(ctx, kafkainbox.NewMessage(id, nil, []byte(`{"total": 10}`))); err != nil {
			log.Fatal(err)
		}
	}
	_ = w.Close()

	cfg, err := pgxpool.ParseConfig(pgURL)
	if err != nil {
		log.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = name
	ex.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := migrations.New(ex.pool, migrations.Config{Schema: name}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	ex.tearDown = func() {
		_, _ = ex.pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE")
		ex.pool.Close()
	}
	return ex
}
