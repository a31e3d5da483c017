package outbox_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// A consumer's handler announces what it did: the outbox message commits
// with the handler's writes and the ledger row, the relay publishes it to
// Kafka once, with an ID derived from the event (the same on a retry).
// DATABASE_URL and KAFKA_BROKERS point at Postgres and Kafka.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrations.New(pool, migrations.Config{Schema: "shop"}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	ledger, err := inbox.New(pool, inbox.Config{Schema: "shop"})
	if err != nil {
		log.Fatal(err)
	}
	ob, err := outbox.New(pool, outbox.Config{Schema: "shop"})
	if err != nil {
		log.Fatal(err)
	}
	topic := exampleTopic() // "payments.done", in a real application

	// The handler: its writes and its message commit together, or neither.
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := ob.Add(ctx, tx, outbox.Message{
			Broker: outbox.Kafka,
			Topic:  topic,
			Key:    []byte("order-42"),
			Value:  []byte(`{"order":"42","paid":true}`),
		})
		return err
	}
	p, err := consumer.New(consumer.Config{Ledger: ledger, Scope: "payments"}, handler)
	if err != nil {
		log.Fatal(err)
	}
	eventID := uuid.NewString() // from the message, in a real consumer
	for range 2 {               // delivered twice
		d := p.Process(ctx, &consumer.Message{ID: eventID, Topic: "payments"})
		fmt.Println("delivery:", d.Outcome.Disposition)
	}

	// The relay, in the consumer's process or a process of its own. Its
	// Kafka publisher: kafka-go here; franzinbox.NewOutboxPublisher for
	// franz-go.
	w := &kafka.Writer{Addr: kafka.TCP(strings.Split(os.Getenv("KAFKA_BROKERS"), ",")...)}
	defer w.Close()
	pub, err := kafkainbox.NewOutboxPublisher(w)
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

	r := kafka.NewReader(kafka.ReaderConfig{Brokers: strings.Split(os.Getenv("KAFKA_BROKERS"), ","), Topic: topic})
	defer r.Close()
	rd, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	m, err := r.ReadMessage(rd)
	if err != nil {
		log.Fatal(err)
	}
	var ceID string
	for _, h := range m.Headers {
		if h.Key == "ce_id" {
			ceID = string(h.Value)
		}
	}
	fmt.Printf("published %s: %s\n", m.Key, m.Value)
	fmt.Println("ID derived from the event:", ceID == outbox.EventID(inbox.Key{Scope: "payments", ID: eventID}, 0))
	stop()
	if err := <-done; err != nil {
		log.Fatal(err)
	}
	// Output:
	// delivery: executed
	// delivery: duplicate
	// published order-42: {"order":"42","paid":true}
	// ID derived from the event: true
}

// An HTTP handler behind the idempotency bridge adds its message with the
// bridge's transaction: a retried request replays the stored response and
// adds nothing.
func ExampleOutbox_Add_httpBridge() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrations.New(pool, migrations.Config{Schema: "shop_http"}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	ledger, err := inbox.New(pool, inbox.Config{Schema: "shop_http"})
	if err != nil {
		log.Fatal(err)
	}
	ob, err := outbox.New(pool, outbox.Config{Schema: "shop_http"})
	if err != nil {
		log.Fatal(err)
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		log.Fatal(err)
	}
	var added []string
	createOrder := func(w http.ResponseWriter, r *http.Request) {
		ids, err := ob.Add(r.Context(), httpbridge.Tx(r.Context()), outbox.Message{
			Broker: outbox.NATS,
			Topic:  "orders.created",
			Value:  []byte(`{"item":"book"}`),
		})
		if err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable) // rolled back: no message
			return
		}
		added = append(added, ids...)
		w.WriteHeader(http.StatusCreated)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})(http.HandlerFunc(createOrder)))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	key := uuid.NewString()
	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("messages added:", len(added))
	// (No relay runs in this example: it removes its message.)
	if _, err := pool.Exec(ctx, `DELETE FROM shop_http.outbox WHERE id = ANY($1)`, added); err != nil {
		log.Fatal(err)
	}
	// Output:
	// 201 replayed: false
	// 201 replayed: true
	// messages added: 1
}
