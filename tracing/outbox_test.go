package tracing_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/tracing"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// Across two services over real Kafka: a producer's span, the orders
// service's handler span under it; that handler adds an outbox message in
// its transaction, the relay publishes it, and the shipping service's
// handler span is the orders handler's child. One trace, three hops.
func TestOutboxTraceAcrossServices(t *testing.T) {
	sp := newSpans(t)
	pg := testsvc.Postgres(t)
	brokers := testsvc.KafkaBrokers(t)
	orders, shipments := testsvc.Unique("orders"), testsvc.Unique("shipments")
	createTopics(t, brokers, orders, shipments)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	ob, err := outbox.New(pg.Pool, outbox.Config{Schema: pg.Schema})
	require.NoError(t, err)

	ordersSvc, err := kafkainbox.New(kafkainbox.Config{
		Brokers: brokers, Topic: orders, GroupID: "orders", Reader: tuneReader,
		Processor: consumer.Config{Ledger: ledger,
			Middleware: []consumer.Middleware{tracing.Middleware(sp.tp, "orders")}},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := ob.Add(ctx, tx, outbox.Message{Broker: outbox.Kafka, Topic: shipments, Key: m.Key, Value: []byte(`{"ship":true}`)})
		return err
	})
	require.NoError(t, err)
	shippingSvc, err := kafkainbox.New(kafkainbox.Config{
		Brokers: brokers, Topic: shipments, GroupID: "shipping", Reader: tuneReader,
		Processor: consumer.Config{Ledger: ledger,
			Middleware: []consumer.Middleware{tracing.Middleware(sp.tp, "shipping")}},
	}, func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	require.NoError(t, err)
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), RequiredAcks: kafka.RequireAll, BatchSize: 1, Transport: &kafka.Transport{}}
	t.Cleanup(func() { _ = w.Close() })
	pub, err := kafkainbox.NewOutboxPublisher(w)
	require.NoError(t, err)
	relay, err := ob.Relay(outbox.RelayConfig{Publishers: map[outbox.Broker]outbox.Publisher{outbox.Kafka: pub}})
	require.NoError(t, err)
	for _, r := range []interface{ Run(context.Context) error }{ordersSvc, shippingSvc, relay} {
		stop, _ := consumertest.Start(t, r)
		defer stop()
	}

	producer, hs := sp.produce("order-1")
	require.NoError(t, w.WriteMessages(context.Background(),
		kafka.Message{Topic: orders, Key: []byte("k"), Value: []byte("{}"), Headers: kafkaHeaders(hs)}))

	var ordersRun, shippingRun = -1, -1
	runs := sp.await(t, tracing.SpanName, producer.TraceID(), 2)
	for i, s := range runs {
		scope, _ := attr(s, "justonce.scope")
		switch scope {
		case "orders":
			ordersRun = i
		case "shipping":
			shippingRun = i
		}
	}
	require.NotEqual(t, -1, ordersRun)
	require.NotEqual(t, -1, shippingRun)
	requireChild(t, producer, runs[ordersRun])
	requireChild(t, runs[ordersRun].SpanContext, runs[shippingRun])
}
