package tracing_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/tracing"
	"github.com/justonce/justonce/transports/natsinbox"
)

// The same trace over a real NATS JetStream (embedded server): the handler
// span is the producer's child; a failing message's dead letter, published
// with consumer.DeadLetterHeadersContext, makes the dead-letter consumer's
// span a child of the failed run.
func TestNATSTraceEndToEnd(t *testing.T) {
	sp := newSpans(t)
	pg := testsvc.Postgres(t)
	nc, err := nats.Connect(testsvc.NATSURL(t))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	subject := testsvc.Unique("orders")
	for _, s := range []jetstream.StreamConfig{
		{Name: subject, Subjects: []string{subject}},
		{Name: subject + "-dlq", Subjects: []string{subject + natsinbox.DeadLetterSuffix}},
	} {
		_, err := js.CreateStream(ctx, s)
		require.NoError(t, err)
	}
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)

	orders, err := natsinbox.New(natsinbox.Config{Conn: nc, Stream: subject, Durable: "orders",
		Processor: consumer.Config{
			Ledger:     ledger,
			Middleware: []consumer.Middleware{tracing.Middleware(sp.tp, "orders")},
			DeadLetter: func(ctx context.Context, m *consumer.Message, cause error) error {
				out := nats.NewMsg(m.Topic + natsinbox.DeadLetterSuffix)
				for _, h := range consumer.DeadLetterHeadersContext(ctx, "orders", m, cause) {
					if h.Key != jetstream.MsgIDHeader {
						out.Header.Add(h.Key, string(h.Value))
					}
				}
				out.Data = m.Value
				_, err := js.PublishMsg(ctx, out)
				return err
			},
		}}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "order-bad" {
			return consumer.Permanent(errors.New("card declined"))
		}
		_, span := sp.tp.Tracer("test-handler").Start(ctx, "charge card")
		span.End()
		return nil
	})
	require.NoError(t, err)
	stopOrders, _ := consumertest.Start(t, orders)
	defer stopOrders()
	dlq, err := natsinbox.New(natsinbox.Config{Conn: nc, Stream: subject + "-dlq", Durable: "orders-dlq",
		Processor: consumer.Config{Ledger: ledger,
			Middleware: []consumer.Middleware{tracing.Middleware(sp.tp, "orders-dlq")}},
	}, func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	require.NoError(t, err)
	stopDLQ, _ := consumertest.Start(t, dlq)
	defer stopDLQ()

	okSC, okHs := sp.produce("order-ok")
	badSC, badHs := sp.produce("order-bad")
	// The good message first, and the failing one once it ran: in one
	// batch, the failing handler would make the good one's run again (its
	// first run rolled back with the batch's transaction), two spans.
	publish := func(hs tracing.HeaderCarrier) {
		m := nats.NewMsg(subject)
		m.Data = []byte("{}")
		for _, h := range hs {
			m.Header.Set(h.Key, string(h.Value))
		}
		_, err := js.PublishMsg(ctx, m)
		require.NoError(t, err)
	}
	publish(okHs)

	h := sp.await(t, tracing.SpanName, okSC.TraceID(), 1)[0]
	requireChild(t, okSC, h)
	require.True(t, h.Parent.IsRemote())
	dest, _ := attr(h, "messaging.destination.name")
	require.Equal(t, subject, dest)
	requireChild(t, h.SpanContext, sp.await(t, "charge card", okSC.TraceID(), 1)[0])

	publish(badHs)
	bad := sp.await(t, tracing.SpanName, badSC.TraceID(), 2)
	failed := bad[0]
	if failed.Parent.SpanID() != badSC.SpanID() {
		failed = bad[1]
	}
	requireChild(t, badSC, failed)
	require.Equal(t, codes.Error, failed.Status.Code)
	dead := bad[0]
	if dead.SpanContext.SpanID() == failed.SpanContext.SpanID() {
		dead = bad[1]
	}
	requireChild(t, failed.SpanContext, dead)
	scope, _ := attr(dead, "justonce.scope")
	require.Equal(t, "orders-dlq", scope)
}
