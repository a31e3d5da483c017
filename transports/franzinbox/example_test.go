package franzinbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/transports/franzinbox"
)

// A billing consumer: each order event creates one invoice, in the same
// transaction as its ledger row. The producer retried order-2, so Kafka
// holds it twice; the second copy is acknowledged without running the
// handler.
//
// The same program runs on kafka-go (kafkainbox's ExampleNew) and on NATS
// (natsinbox's): only the import and the Config line differ.
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

	c, err := franzinbox.New(franzinbox.Config{Brokers: ex.brokers, Topics: []string{ex.topic}, GroupID: ex.group, Processor: processor}, handler)
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

// A transactional producer writes order-1 and order-2, aborts, and writes
// order-2 and order-3 again in a transaction it commits. The Consumer reads
// committed: the aborted records never reach the handler, so order-1 never
// runs and order-2 runs once, from its committed copy.
func ExampleNew_readCommitted() {
	ex := setUp() // no events: the transactional producer below writes them
	defer ex.tearDown()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()

	producer, err := kgo.NewClient(
		kgo.SeedBrokers(ex.brokers...),
		kgo.DefaultProduceTopic(ex.topic),
		kgo.TransactionalID("billing-producer-"+ex.topic),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer producer.Close()
	inTransaction := func(commit kgo.TransactionEndTry, ids ...string) {
		if err := producer.BeginTransaction(); err != nil {
			log.Fatal(err)
		}
		for _, id := range ids {
			if err := producer.ProduceSync(ctx, franzinbox.NewRecord(id, nil, []byte(`{"total": 10}`))).FirstErr(); err != nil {
				log.Fatal(err)
			}
		}
		if err := producer.EndTransaction(ctx, commit); err != nil {
			log.Fatal(err)
		}
	}
	inTransaction(kgo.TryAbort, "order-1", "order-2")
	inTransaction(kgo.TryCommit, "order-2", "order-3")

	ledger, err := inbox.New(ex.pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	var answered atomic.Int32
	processor := consumer.Config{
		Ledger: ledger,
		Hooks: consumer.Hooks{OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
			fmt.Println(m.ID, out.Disposition, "offset", m.Offset)
			if answered.Add(1) == 2 {
				stop()
			}
		}},
	}
	c, err := franzinbox.New(franzinbox.Config{Brokers: ex.brokers, Topics: []string{ex.topic}, GroupID: ex.group, Processor: processor},
		func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
	// Output:
	// order-2 executed offset 3
	// order-3 executed offset 4
}

func ExampleNewRecord() {
	r := franzinbox.NewRecord("order-42", []byte("customer-7"), []byte(`{"total": 10}`))
	fmt.Printf("%s=%s key=%s\n", r.Headers[0].Key, r.Headers[0].Value, r.Key)
	// Output: event-id=order-42 key=customer-7
}

// example is what the examples run against: a one-partition topic of their
// own, a consumer group name, and a pool on a migrated schema of their own.
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
// a migrated schema, and publishes one record per ID to the topic, in
// order, the ID in the event-id header.
func setUp(ids ...string) example {
	ctx := context.Background()
	pgURL, kafkaAddr := os.Getenv("JUSTONCE_TEST_POSTGRES_URL"), os.Getenv("JUSTONCE_TEST_KAFKA_BROKERS")
	if pgURL == "" || kafkaAddr == "" {
		log.Fatal("example: set JUSTONCE_TEST_POSTGRES_URL and JUSTONCE_TEST_KAFKA_BROKERS (`make services-up` starts both)")
	}
	ex := example{brokers: strings.Split(kafkaAddr, ",")}
	suffix := make([]byte, 5)
	_, _ = rand.Read(suffix)
	name := "exf_" + hex.EncodeToString(suffix)
	ex.topic = strings.ReplaceAll(name, "_", "-")
	ex.group = "billing-" + ex.topic

	cl, err := kgo.NewClient(kgo.SeedBrokers(ex.brokers...))
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	if _, err := adm.CreateTopic(ctx, 1, 1, nil, ex.topic); err != nil {
		log.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if td, err := adm.ListTopics(ctx, ex.topic); err == nil && td.Error() == nil && len(td[ex.topic].Partitions) == 1 && td[ex.topic].Partitions[0].Leader >= 0 {
			break
		}
		if time.Now().After(deadline) {
			log.Fatal("example: topic has no leader")
		}
	}

	ex.produce(ids...)

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

// produce publishes one record per ID to the example's topic, in order, the
// ID in the event-id header.
func (ex example) produce(ids ...string) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(ex.brokers...), kgo.DefaultProduceTopic(ex.topic))
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()
	for _, id := range ids {
		if err := cl.ProduceSync(context.Background(), franzinbox.NewRecord(id, nil, []byte(`{"total": 10}`))).FirstErr(); err != nil {
			log.Fatal(err)
		}
	}
}
