package tracing_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/tracing"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// One trace over real Kafka: a producer's span, the handler's span as its
// child (and the handler's own span under that, and its log line stamped
// with the trace); a message whose handler fails goes to the dead-letter
// topic pointing at the failed run, and the dead-letter consumer's span is
// that run's child.
func TestKafkaTraceEndToEnd(t *testing.T) {
	sp := newSpans(t)
	pg := testsvc.Postgres(t)
	brokers := testsvc.KafkaBrokers(t)
	topic := testsvc.Unique("trace")
	dlq := topic + kafkainbox.DeadLetterSuffix
	createTopics(t, brokers, topic, dlq)

	var logs testsvc.LogBuffer
	logger := slog.New(tracing.LogHandler(slog.NewJSONHandler(&logs, nil)))
	ledger, err := inbox.New(pg.Pool, inbox.Config{Logger: logger})
	require.NoError(t, err)

	okSC, okHs := sp.produce("order-ok")
	badSC, badHs := sp.produce("order-bad")
	require.NotEqual(t, okSC.TraceID(), badSC.TraceID())

	// The orders consumer; its dead letters are published with
	// consumer.DeadLetterHeadersContext, as the fronts do.
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), RequiredAcks: kafka.RequireAll, BatchSize: 1, Transport: &kafka.Transport{}}
	t.Cleanup(func() { _ = w.Close() })
	orders, err := kafkainbox.New(kafkainbox.Config{
		Brokers: brokers, Topic: topic, GroupID: "orders", Reader: tuneReader,
		Processor: consumer.Config{
			Ledger:     ledger,
			Middleware: []consumer.Middleware{tracing.Middleware(sp.tp, "orders")},
			DeadLetter: func(ctx context.Context, m *consumer.Message, cause error) error {
				return w.WriteMessages(ctx, kafka.Message{Topic: dlq, Key: m.Key, Value: m.Value,
					Headers: kafkaHeaders(consumer.DeadLetterHeadersContext(ctx, "orders", m, cause))})
			},
		},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "order-bad" {
			return consumer.Permanent(errors.New("card declined"))
		}
		_, span := sp.tp.Tracer("test-handler").Start(ctx, "charge card")
		span.End()
		ledger.Logger().InfoContext(ctx, "charged", "order", m.ID)
		return nil
	})
	require.NoError(t, err)
	stopOrders, _ := consumertest.Start(t, orders)
	defer stopOrders()

	// The dead-letter topic's consumer.
	dlqc, err := kafkainbox.New(kafkainbox.Config{
		Brokers: brokers, Topic: dlq, GroupID: "orders-dlq", Reader: tuneReader,
		Processor: consumer.Config{Ledger: ledger,
			Middleware: []consumer.Middleware{tracing.Middleware(sp.tp, "orders-dlq")}},
	}, func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	require.NoError(t, err)
	stopDLQ, _ := consumertest.Start(t, dlqc)
	defer stopDLQ()

	// The good message first, and the failing one once it ran: in one
	// batch, the failing handler would make the good one's run again (its
	// first run rolled back with the batch's transaction), two spans.
	require.NoError(t, w.WriteMessages(context.Background(),
		kafka.Message{Topic: topic, Key: []byte("k"), Value: []byte("{}"), Headers: kafkaHeaders(okHs)}))

	// The handler's span is the producer's child, and links to it.
	h := sp.await(t, tracing.SpanName, okSC.TraceID(), 1)[0]
	requireChild(t, okSC, h)
	require.True(t, h.Parent.IsRemote(), "the parent came over the wire")
	require.Equal(t, trace.SpanKindConsumer, h.SpanKind)
	require.Len(t, h.Links, 1)
	require.Equal(t, okSC.SpanID(), h.Links[0].SpanContext.SpanID())
	dest, _ := attr(h, "messaging.destination.name")
	require.Equal(t, topic, dest)
	// The handler's own span is the handler span's child.
	requireChild(t, h.SpanContext, sp.await(t, "charge card", okSC.TraceID(), 1)[0])
	// Its log line carries the trace.
	testsvc.Eventually(t, 10*time.Second, func() bool { return strings.Contains(logs.String(), `"msg":"charged"`) }, "log line")
	line := logLine(t, logs.String(), "charged")
	require.Equal(t, okSC.TraceID().String(), line["trace_id"])
	require.Equal(t, h.SpanContext.SpanID().String(), line["span_id"])

	// The failing run: the producer's child, failed.
	require.NoError(t, w.WriteMessages(context.Background(),
		kafka.Message{Topic: topic, Key: []byte("k"), Value: []byte("{}"), Headers: kafkaHeaders(badHs)}))
	bad := sp.await(t, tracing.SpanName, badSC.TraceID(), 2) // the run, and the dead letter's consumer
	var failed, dead trace.SpanContext
	for _, s := range bad {
		if s.Parent.SpanID() == badSC.SpanID() {
			failed = s.SpanContext
			require.Equal(t, codes.Error, s.Status.Code)
			require.Equal(t, "card declined", s.Status.Description)
		}
	}
	for _, s := range bad {
		if s.SpanContext.SpanID() != failed.SpanID() {
			dead = s.SpanContext
			// The dead letter's consumer continues the trace under the
			// failed run.
			requireChild(t, failed, s)
			scope, _ := attr(s, "justonce.scope")
			require.Equal(t, "orders-dlq", scope)
		}
	}
	require.True(t, failed.IsValid(), "a span for the failed run")
	require.True(t, dead.IsValid(), "a span for the dead letter's run")
}

func kafkaHeaders(hs []consumer.Header) []kafka.Header {
	out := make([]kafka.Header, len(hs))
	for i, h := range hs {
		out[i] = kafka.Header{Key: h.Key, Value: h.Value}
	}
	return out
}

// logLine returns the JSON log line whose msg is msg.
func logLine(t testing.TB, logs, msg string) map[string]any {
	t.Helper()
	for _, l := range strings.Split(logs, "\n") {
		var m map[string]any
		if json.Unmarshal([]byte(l), &m) == nil && m["msg"] == msg {
			return m
		}
	}
	t.Fatalf("no log line %q in:\n%s", msg, logs)
	return nil
}

func tuneReader(rc *kafka.ReaderConfig) {
	rc.SessionTimeout = 6 * time.Second
	rc.RebalanceTimeout = 6 * time.Second
	rc.HeartbeatInterval = 300 * time.Millisecond
	rc.JoinGroupBackoff = 200 * time.Millisecond
	rc.MaxWait = 300 * time.Millisecond
	rc.StartOffset = kafka.FirstOffset
}

// createTopics creates one-partition topics on the controller and waits
// for their leaders.
func createTopics(t testing.TB, brokers []string, names ...string) {
	t.Helper()
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	ctrl, err := conn.Controller()
	require.NoError(t, err)
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	require.NoError(t, err)
	defer cc.Close()
	for _, n := range names {
		require.NoError(t, cc.CreateTopics(kafka.TopicConfig{Topic: n, NumPartitions: 1, ReplicationFactor: 1}))
		testsvc.Eventually(t, 30*time.Second, func() bool {
			ps, err := conn.ReadPartitions(n)
			return err == nil && len(ps) == 1 && ps[0].Leader.Host != ""
		}, "topic %s has a leader", n)
	}
}
