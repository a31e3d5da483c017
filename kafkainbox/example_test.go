package kafkainbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/kafkainbox"
	"github.com/justonce/justonce/migrations"
)

// A billing consumer: each order event creates one invoice, in the same
// transaction as its ledger row. The producer retried order-2, so Kafka
// holds it twice; the second copy is acknowledged without running the
// handler.
func Example() {
	ctx := context.Background()
	brokers, topic, pool, cleanup := exampleServices() // a topic, and a pool on a migrated schema
	defer cleanup()

	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE invoices (order_id text PRIMARY KEY)`); err != nil {
		panic(err)
	}

	// Producer side: the event ID travels in the event-id header.
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, RequiredAcks: kafka.RequireAll, Transport: &kafka.Transport{}}
	if err := w.WriteMessages(ctx,
		kafkainbox.NewMessage("order-1", []byte("customer-7"), []byte(`{"total": 10}`)),
		kafkainbox.NewMessage("order-2", []byte("customer-9"), []byte(`{"total": 25}`)),
		kafkainbox.NewMessage("order-2", []byte("customer-9"), []byte(`{"total": 25}`)), // a producer retry
	); err != nil {
		panic(err)
	}
	_ = w.Close()

	// Consumer side.
	runCtx, stop := context.WithCancel(ctx)
	var answered atomic.Int32
	c, err := kafkainbox.New(kafkainbox.Config{
		Brokers: brokers,
		Topic:   topic,
		GroupID: "billing-" + topic,
		Processor: consumer.Config{
			Ledger: ledger,
			Hooks: consumer.Hooks{OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
				fmt.Println(m.ID, out.Disposition)
				if answered.Add(1) == 3 {
					stop() // graceful: finish, commit offsets, leave the group
				}
			}},
		},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
		return err
	})
	if err != nil {
		panic(err)
	}
	if err := c.Run(runCtx); err != nil {
		panic(err)
	}

	var invoices int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM invoices`).Scan(&invoices); err != nil {
		panic(err)
	}
	fmt.Println("invoices:", invoices)
	// Output:
	// order-1 executed
	// order-2 executed
	// order-2 duplicate
	// invoices: 2
}

func ExampleNewMessage() {
	m := kafkainbox.NewMessage("order-42", []byte("customer-7"), []byte(`{"total": 10}`))
	fmt.Printf("%s=%s key=%s\n", m.Headers[0].Key, m.Headers[0].Value, m.Key)
	// Output: event-id=order-42 key=customer-7
}

// exampleServices finds the test services (as the tests do, from the
// environment or .services.env), creates a one-partition topic and a
// migrated schema of its own, and returns a cleanup.
func exampleServices() (brokers []string, topic string, pool *pgxpool.Pool, cleanup func()) {
	ctx := context.Background()
	pgURL, kafkaAddr := testsvc.Getenv(testsvc.EnvPostgres), testsvc.Getenv(testsvc.EnvKafka)
	if pgURL == "" || kafkaAddr == "" {
		panic("example: start the test services with `make services-up`, or set " + testsvc.EnvPostgres + " and " + testsvc.EnvKafka)
	}
	brokers = strings.Split(kafkaAddr, ",")
	suffix := make([]byte, 5)
	_, _ = rand.Read(suffix)
	name := "ex_" + hex.EncodeToString(suffix)
	topic = strings.ReplaceAll(name, "_", "-")

	conn, err := kafka.Dial("tcp", brokers[0])
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	ctrl, err := conn.Controller()
	if err != nil {
		panic(err)
	}
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	if err != nil {
		panic(err)
	}
	defer cc.Close()
	if err := cc.CreateTopics(kafka.TopicConfig{Topic: topic, NumPartitions: 1, ReplicationFactor: 1}); err != nil {
		panic(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if ps, err := conn.ReadPartitions(topic); err == nil && len(ps) == 1 && ps[0].Leader.Host != "" {
			break
		}
		if time.Now().After(deadline) {
			panic("example: topic has no leader")
		}
	}

	cfg, err := pgxpool.ParseConfig(pgURL)
	if err != nil {
		panic(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = name
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		panic(err)
	}
	if _, err := migrations.New(pool, migrations.Config{Schema: name}).Up(ctx); err != nil {
		panic(err)
	}
	return brokers, topic, pool, func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE")
		pool.Close()
	}
}
