package outbox_test

import (
	"context"
	"encoding/base64"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
)

// A rolled-back transaction publishes nothing; a committed one publishes
// each message once, with its ID and headers, on Kafka and on NATS.
func TestRollbackNothingCommitOnce(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 8)
	ns := newNATS(t)
	topic := newTopic(t, fx.brokers, 3)
	subject := testsvc.Unique("orders")
	stream := ns.stream(t, subject, time.Minute)
	ctx := context.Background()

	// Rolled back: a Kafka and a NATS message.
	tx, err := fx.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = fx.ob.Add(ctx, tx,
		outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte("rolled back")},
		outbox.Message{Broker: outbox.NATS, Topic: subject, Value: []byte("rolled back")})
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))

	// Committed.
	ids := fx.add(t,
		outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte("v1"),
			Headers: []consumer.Header{{Key: "type", Value: []byte("order.created")}}},
		outbox.Message{Broker: outbox.NATS, Topic: subject, Key: []byte("k"), Value: []byte("v2"),
			Headers: []consumer.Header{{Key: "type", Value: []byte("order.created")}}},
		outbox.Message{ID: "my-id", Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte("v3")})
	require.Len(t, ids, 3)
	for _, id := range ids[:2] {
		u, err := uuid.Parse(id)
		require.NoError(t, err, "outside a handler: a random UUID")
		require.Equal(t, uuid.Version(4), u.Version())
	}
	require.Equal(t, "my-id", ids[2])

	var mu sync.Mutex
	published := map[outbox.Broker]int{}
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(fx.kafka(t), ns.publisher(t)), Hooks: outbox.RelayHooks{
		OnPublished: func(b outbox.Broker, _, n int) { mu.Lock(); published[b] += n; mu.Unlock() },
	}})
	fx.waitDrained(t, 60*time.Second)

	msgs := allMessages(readTopic(t, fx.brokers, topic))
	require.Len(t, msgs, 2, "only the committed messages, once each")
	require.Equal(t, "v1", string(msgs[0].Value))
	require.Equal(t, "k", string(msgs[0].Key))
	require.Equal(t, ids[0], header(msgs[0], "ce_id"))
	require.Equal(t, "order.created", header(msgs[0], "type"))
	require.Equal(t, "v3", string(msgs[1].Value))
	require.Equal(t, "my-id", header(msgs[1], "ce_id"))

	nm := ns.streamMessages(t, stream)
	require.Len(t, nm, 1)
	require.Equal(t, "v2", string(nm[0].Data))
	require.Equal(t, ids[1], nm[0].Header.Get("Nats-Msg-Id"))
	require.Equal(t, "order.created", nm[0].Header.Get("type"))

	mu.Lock()
	require.Equal(t, map[outbox.Broker]int{outbox.Kafka: 2, outbox.NATS: 1}, published)
	mu.Unlock()
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM outbox`), "published rows are deleted")
}

// Add refuses a message without a topic or with an unknown broker.
func TestAddInvalid(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 0)
	err := pgx.BeginFunc(context.Background(), fx.pg.Pool, func(tx pgx.Tx) error {
		_, err := fx.ob.Add(context.Background(), tx, outbox.Message{Broker: outbox.Kafka})
		return err
	})
	require.ErrorIs(t, err, outbox.ErrInvalidMessage)
	err = pgx.BeginFunc(context.Background(), fx.pg.Pool, func(tx pgx.Tx) error {
		_, err := fx.ob.Add(context.Background(), tx, outbox.Message{Broker: "rabbit", Topic: "t"})
		return err
	})
	require.ErrorIs(t, err, outbox.ErrInvalidMessage)
}

// EventID is a version 8 UUID of the event's key and the message's place,
// and differs in each part.
func TestEventID(t *testing.T) {
	t.Parallel()
	k := inbox.Key{Scope: "s", Tenant: "t", ID: "e"}
	id := outbox.EventID(k, 0)
	u, err := uuid.Parse(id)
	require.NoError(t, err)
	require.Equal(t, uuid.Version(8), u.Version())
	require.Equal(t, uuid.RFC4122, u.Variant())
	require.Equal(t, id, outbox.EventID(k, 0))
	seen := map[string]bool{id: true}
	for _, other := range []string{
		outbox.EventID(k, 1),
		outbox.EventID(inbox.Key{Scope: "s", Tenant: "t", ID: "e2"}, 0),
		outbox.EventID(inbox.Key{Scope: "st", Tenant: "", ID: "e"}, 0), // length prefixes: no ambiguity
		outbox.EventID(inbox.Key{Scope: "s", Tenant: "te", ID: ""}, 0),
	} {
		require.False(t, seen[other], other)
		seen[other] = true
	}
	ctx := inbox.WithEvent(context.Background(), k)
	require.Equal(t, outbox.EventID(k, 0), outbox.DeriveID(ctx))
	require.Equal(t, outbox.EventID(k, 1), outbox.DeriveID(ctx))
}

// A handler run through the real runtime that adds messages and fails its
// first attempt writes the same IDs on the retry; only the committed run's
// messages are published.
func TestDeterministicIDsAcrossRetries(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 8)
	topic := newTopic(t, fx.brokers, 1)
	ledger, err := inbox.New(fx.pg.Pool, inbox.Config{})
	require.NoError(t, err)

	var mu sync.Mutex
	runs := map[int][]string{} // attempt -> IDs
	p, err := consumer.New(consumer.Config{
		Ledger:      ledger,
		Scope:       "orders",
		MaxAttempts: 3,
		Backoff:     backoff.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		ids, err := fx.ob.Add(ctx, tx,
			outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("order-1"), Value: []byte("created")},
			outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("order-1"), Value: []byte("paid")})
		if err != nil {
			return err
		}
		mu.Lock()
		runs[m.Attempt] = ids
		mu.Unlock()
		if m.Attempt == 1 {
			return errors.New("the first attempt fails after adding its messages")
		}
		return nil
	})
	require.NoError(t, err)
	m := &consumer.Message{ID: "evt-1", Topic: "in", Value: []byte("x")}
	d := p.ProcessWithRetry(context.Background(), m, func(ctx context.Context, d time.Duration) error {
		time.Sleep(d)
		return nil
	})
	require.Equal(t, consumer.Ack, d.Action, "%+v", d)

	mu.Lock()
	require.Len(t, runs, 2, "two runs")
	require.Equal(t, runs[1], runs[2], "the retry writes the same IDs")
	want := []string{outbox.EventID(inbox.Key{Scope: "orders", ID: "evt-1"}, 0), outbox.EventID(inbox.Key{Scope: "orders", ID: "evt-1"}, 1)}
	require.Equal(t, want, runs[2])
	mu.Unlock()

	fx.relay(t, outbox.RelayConfig{Publishers: publishers(fx.kafka(t), nil)})
	fx.waitDrained(t, 60*time.Second)
	msgs := allMessages(readTopic(t, fx.brokers, topic))
	require.Len(t, msgs, 2, "the failed run's messages rolled back with it")
	for i, m := range msgs {
		require.Equal(t, want[i], header(m, "ce_id"))
	}
	require.Equal(t, "created", string(msgs[0].Value))
	require.Equal(t, "paid", string(msgs[1].Value))
}

// Stats, Retry and Purge on failed messages.
func TestOperations(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 4)
	ctx := context.Background()
	ids := fx.add(t,
		outbox.Message{Broker: outbox.Kafka, Topic: "a", Value: []byte("1")},
		outbox.Message{Broker: outbox.Kafka, Topic: "b", Value: []byte("2")},
		outbox.Message{Broker: outbox.NATS, Topic: "c", Value: []byte("3")})
	st, err := fx.ob.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(3), st.Pending)
	require.Zero(t, st.Failed)
	require.False(t, st.OldestPending.IsZero())
	require.GreaterOrEqual(t, st.OldestPendingAge, time.Duration(0))

	fx.pg.Exec(t, `UPDATE outbox SET status = 'failed', error = 'refused', failed_at = now() - interval '2 hours' WHERE id = ANY($1)`, ids[:2])
	st, err = fx.ob.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), st.Pending)
	require.Equal(t, int64(2), st.Failed)

	n, err := fx.ob.Retry(ctx, ids[0])
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	n, err = fx.ob.Retry(ctx, ids[0])
	require.NoError(t, err)
	require.Zero(t, n, "not failed any more")

	n, err = fx.ob.Purge(ctx, outbox.PurgeOptions{OlderThan: 3 * time.Hour})
	require.NoError(t, err)
	require.Zero(t, n, "failed 2 h ago: not older than 3 h")
	n, err = fx.ob.Purge(ctx, outbox.PurgeOptions{OlderThan: time.Hour})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	n, err = fx.ob.Purge(ctx, outbox.PurgeOptions{})
	require.NoError(t, err)
	require.Zero(t, n, "pending messages are never purged")
	st, err = fx.ob.Stats(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(2), st.Pending)
	require.Zero(t, st.Failed)

}

// Add injects the W3C trace context of its ctx into the message headers
// when a propagator is set, after the message's own headers; a header the
// message sets itself wins. (Not parallel: it sets the global propagator.)
func TestAddInjectsTraceContext(t *testing.T) {
	prev := otel.GetTextMapPropagator()
	otel.SetTextMapPropagator(propagation.TraceContext{})
	t.Cleanup(func() { otel.SetTextMapPropagator(prev) })

	fx := newFixture(t, 4)
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID:     trace.SpanID{1, 2, 3, 4, 5, 6, 7, 8},
		TraceFlags: trace.FlagsSampled,
	})
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	err := pgx.BeginFunc(ctx, fx.pg.Pool, func(tx pgx.Tx) error {
		_, err := fx.ob.Add(ctx, tx,
			outbox.Message{Broker: outbox.Kafka, Topic: "t", Headers: []consumer.Header{{Key: "type", Value: []byte("x")}}},
			outbox.Message{Broker: outbox.Kafka, Topic: "t", Headers: []consumer.Header{{Key: "traceparent", Value: []byte("mine")}}})
		return err
	})
	require.NoError(t, err)
	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT headers::text FROM outbox ORDER BY seq`)
	require.NoError(t, err)
	hs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Len(t, hs, 2)
	want := base64.StdEncoding.EncodeToString([]byte("00-0102030405060708090a0b0c0d0e0f10-0102030405060708-01"))
	require.Contains(t, hs[0], `"k": "type"`)
	require.Contains(t, hs[0], `"k": "traceparent", "v": "`+want+`"`)
	require.Contains(t, hs[1], base64.StdEncoding.EncodeToString([]byte("mine")))
	require.NotContains(t, hs[1], want, "the message's own header wins")
}

// Inside Ledger.Do the messages' INSERT is sent with the commit: a handler
// that reuses one buffer for each message's value still stores each value.
func TestAddInDoCopiesTheCallersBuffers(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 8)
	ledger, err := inbox.New(fx.pg.Pool, inbox.Config{})
	require.NoError(t, err)
	_, err = ledger.Do(context.Background(), inbox.Request{Key: inbox.Key{Scope: "orders", ID: "reuse"}},
		func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			buf := make([]byte, 0, 16)
			for _, v := range []string{"created", "paid"} {
				buf = append(buf[:0], v...)
				if _, err := fx.ob.Add(ctx, tx, outbox.Message{Broker: outbox.Kafka, Topic: "t", Key: buf[:5], Value: buf}); err != nil {
					return inbox.Result{}, err
				}
			}
			return inbox.Result{}, nil
		})
	require.NoError(t, err)
	var values []string
	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT key, value FROM outbox ORDER BY seq`)
	require.NoError(t, err)
	for rows.Next() {
		var k, v []byte
		require.NoError(t, rows.Scan(&k, &v))
		values = append(values, string(k)+"/"+string(v))
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"creat/created", "paidt/paid"}, values) // the key is the buffer's first five bytes
}
