package metrics_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/metrics"
	"github.com/justonce/justonce/tracing"
)

func TestConsumerCollector(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pg := testsvc.Postgres(t)
	pg.Exec(t, "CREATE TABLE effects (id text PRIMARY KEY)")
	l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema})
	require.NoError(t, err)

	cc := metrics.NewConsumerCollector(metrics.ConsumerConfig{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(cc)
	tp := &recorder{}
	p, err := consumer.New(consumer.Config{
		Ledger:      l,
		Scope:       "orders",
		Source:      inbox.Source("kafka"),
		MaxAttempts: 2,
		Hooks:       cc.Hooks("orders", inbox.Source("kafka")),
		Middleware:  []consumer.Middleware{tracing.Middleware(tp, "orders")},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		switch string(m.Value) {
		case "fail":
			return errors.New("boom")
		case "poison":
			return consumer.Permanent(errors.New("cannot parse"))
		}
		_, err := tx.Exec(ctx, "INSERT INTO effects (id) VALUES ($1)", m.ID)
		return err
	})
	require.NoError(t, err)

	msg := func(id, value string, attempt int) *consumer.Message {
		m := &consumer.Message{Topic: "orders.v1", Value: []byte(value), Attempt: attempt}
		if id != "" {
			m.Headers = []consumer.Header{{Key: "event-id", Value: []byte(id)}}
		}
		return m
	}
	process := func(m *consumer.Message, action consumer.Action, deadLettered bool) consumer.Decision {
		t.Helper()
		d := p.Process(ctx, m)
		require.Equal(t, action, d.Action, "%+v", d)
		require.Equal(t, deadLettered, d.DeadLettered, "%+v", d)
		return d
	}

	// e1 runs, then comes again: executed, duplicate.
	process(msg("order-000000001", "ok", 1), consumer.Ack, false)
	process(msg("order-000000001", "ok", 1), consumer.Ack, false)
	// e2 fails, is retried, fails again and is dead-lettered (MaxAttempts
	// 2); a later delivery is a duplicate of the failed row.
	process(msg("order-000000002", "fail", 1), consumer.Retry, false)
	process(msg("order-000000002", "fail", 2), consumer.Ack, true)
	process(msg("order-000000002", "fail", 3), consumer.Ack, false)
	// A permanent error is dead-lettered at once.
	process(msg("order-000000003", "poison", 1), consumer.Ack, true)
	// No ID, and an ID too long for the ledger: dead-lettered unrun.
	process(msg("", "ok", 1), consumer.Ack, true)
	process(msg(strings.Repeat("x", 300), "ok", 1), consumer.Ack, true)
	// In flight: a lease holds the key; the attempt will be retried.
	lease, _, err := l.AcquireLease(ctx, inbox.Request{Key: inbox.Key{Scope: "orders", ID: "order-000000009"}}, time.Minute)
	require.NoError(t, err)
	require.NotNil(t, lease)
	process(msg("order-000000009", "ok", 1), consumer.Retry, false)
	// A batch: two new, one duplicate.
	ds := p.ProcessBatch(ctx, []*consumer.Message{
		msg("order-000000010", "ok", 1), msg("order-000000011", "ok", 1), msg("order-000000001", "ok", 1)})
	for _, d := range ds {
		require.Equal(t, consumer.Ack, d.Action)
	}
	require.Equal(t, 3, pg.Count(t, "SELECT count(*) FROM effects"))

	got := samples(t, reg)
	labels := func(extra string) string { return `{` + extra + `scope="orders",source="kafka"}` }
	require.Equal(t, map[string]float64{
		"justonce_consumer_handler_duration_seconds_count" + labels(`disposition="executed",`):  3,
		"justonce_consumer_handler_duration_seconds_count" + labels(`disposition="duplicate",`): 3,
		"justonce_consumer_handler_duration_seconds_count" + labels(`disposition="in_flight",`): 1,
		"justonce_consumer_retries_total" + labels(""):                                          2,
		"justonce_consumer_dead_lettered_total" + labels(`reason="handler",`):                   2,
		"justonce_consumer_dead_lettered_total" + labels(`reason="no_id",`):                     1,
		"justonce_consumer_dead_lettered_total" + labels(`reason="invalid_key",`):               1,
	}, only(got, "justonce_consumer_handler_duration_seconds_count", "justonce_consumer_retries_total",
		"justonce_consumer_dead_lettered_total"))
	for _, d := range []string{"executed", "duplicate", "in_flight"} {
		sum := got["justonce_consumer_handler_duration_seconds_sum"+labels(`disposition="`+d+`",`)]
		require.Greater(t, sum, 0.0, d)
		require.Less(t, sum, 10.0, d)
	}

	// Spans: one per handler run (e1, e2 twice, the poison message, two in
	// the batch); duplicates, in-flight and unrun messages have none.
	spans := tp.ended()
	require.Len(t, spans, 6)
	failed := 0
	for _, s := range spans {
		require.Equal(t, tracing.TracerName, s.tracer)
		require.Equal(t, tracing.SpanName, s.name)
		require.Equal(t, trace.SpanKindConsumer, s.kind)
		require.Equal(t, attribute.StringValue("orders"), s.attrs["justonce.scope"])
		require.Equal(t, attribute.StringValue("orders.v1"), s.attrs["messaging.destination.name"])
		id := s.attrs["messaging.message.id"].AsString()
		require.Regexp(t, `^orde\*\*\*\*\d{4}$`, id, "event IDs are masked")
		if s.status == codes.Error {
			failed++
			require.Len(t, s.errs, 1)
		}
	}
	require.Equal(t, 3, failed, "e2 twice and the poison message")
}

func TestTracingMiddlewarePanic(t *testing.T) {
	t.Parallel()
	tp := &recorder{}
	h := tracing.Middleware(tp, "s")(func(context.Context, pgx.Tx, *consumer.Message) error { panic("bad") })
	require.PanicsWithValue(t, "bad", func() { _ = h(context.Background(), nil, &consumer.Message{ID: "1"}) })
	spans := tp.ended()
	require.Len(t, spans, 1)
	require.Equal(t, codes.Error, spans[0].status)

	// Without a provider the handler runs as it is.
	ran := false
	h = tracing.Middleware(nil, "s")(func(context.Context, pgx.Tx, *consumer.Message) error { ran = true; return nil })
	require.NoError(t, h(context.Background(), nil, &consumer.Message{}))
	require.True(t, ran)
}
