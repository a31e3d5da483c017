package franzinbox_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

// A franz-go service relays its outbox with franz-go alone: the relay's
// Kafka publisher is franzinbox's, on the service's client, and no other
// Kafka client is linked. The message, added in a transaction of the
// service's, is published once that transaction commits, with its ID in
// the header ce_id.
func ExampleNewOutboxPublisher() {
	ex := setUp() // a topic and a migrated schema
	defer ex.tearDown()
	ctx := context.Background()
	ob, err := outbox.New(ex.pool, outbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, ex.pool, func(tx pgx.Tx) error {
		_, err := ob.Add(ctx, tx, outbox.Message{ID: "invoice-1", Broker: outbox.Kafka, Topic: ex.topic,
			Key: []byte("order-1"), Value: []byte(`{"invoice":1}`)})
		return err
	})
	if err != nil {
		log.Fatal(err)
	}

	// The relay, its Kafka publisher on a franz-go client.
	cl, err := kgo.NewClient(kgo.SeedBrokers(ex.brokers...))
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close() // after the relay stopped
	pub, err := franzinbox.NewOutboxPublisher(cl)
	if err != nil {
		log.Fatal(err)
	}
	relay, err := ob.Relay(outbox.RelayConfig{
		Publishers: map[outbox.Broker]outbox.Publisher{outbox.Kafka: pub},
	})
	if err != nil {
		log.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(rctx) }()

	reader, err := kgo.NewClient(kgo.SeedBrokers(ex.brokers...), kgo.ConsumeTopics(ex.topic))
	if err != nil {
		log.Fatal(err)
	}
	defer reader.Close()
	pctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	fetches := reader.PollRecords(pctx, 1)
	if err := fetches.Err0(); err != nil {
		log.Fatal(err)
	}
	r := fetches.Records()[0]
	fmt.Printf("published %s: %s\n", r.Key, r.Value)
	for _, h := range r.Headers {
		if h.Key == outbox.KafkaIDHeader {
			fmt.Println("ce_id:", string(h.Value))
		}
	}
	stop()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	// Output:
	// published order-1: {"invoice":1}
	// ce_id: invoice-1
}
