package tracing_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/tracing"
)

// TestMain sets the global propagator, as an application does: the
// dead-letter headers and the outbox inject through it. DATABASE_URL,
// which the examples read as a program would, points at the test Postgres.
func TestMain(m *testing.M) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	if os.Getenv("DATABASE_URL") == "" {
		if u := testsvc.Getenv("JUSTONCE_TEST_POSTGRES_URL"); u != "" {
			_ = os.Setenv("DATABASE_URL", u)
		}
	}
	os.Exit(m.Run())
}

// spans is a tracer provider exporting to memory, synchronously.
type spans struct {
	exp *tracetest.InMemoryExporter
	tp  *sdktrace.TracerProvider
}

func newSpans(t testing.TB) *spans {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &spans{exp: exp, tp: tp}
}

// produce starts and ends a producer span, and returns its context with
// the trace headers of a message published in it (plus ce_id = id).
func (s *spans) produce(id string) (trace.SpanContext, tracing.HeaderCarrier) {
	ctx, span := s.tp.Tracer("test-producer").Start(context.Background(), "orders publish",
		trace.WithSpanKind(trace.SpanKindProducer))
	defer span.End()
	hs := tracing.HeaderCarrier{{Key: "ce_id", Value: []byte(id)}}
	otel.GetTextMapPropagator().Inject(ctx, &hs)
	return span.SpanContext(), hs
}

// where returns the ended spans named name in trace tid.
func (s *spans) where(name string, tid trace.TraceID) []tracetest.SpanStub {
	var out []tracetest.SpanStub
	for _, st := range s.exp.GetSpans() {
		if st.Name == name && st.SpanContext.TraceID() == tid {
			out = append(out, st)
		}
	}
	return out
}

// await waits until n spans named name have ended in trace tid and returns
// them.
func (s *spans) await(t testing.TB, name string, tid trace.TraceID, n int) []tracetest.SpanStub {
	t.Helper()
	testsvc.Eventually(t, 60*time.Second, func() bool { return len(s.where(name, tid)) >= n },
		"%d span(s) %q in trace %s", n, name, tid)
	out := s.where(name, tid)
	require.Len(t, out, n, "spans %q in trace %s", name, tid)
	return out
}

// requireChild asserts that child's parent is parent, in the same trace.
func requireChild(t testing.TB, parent trace.SpanContext, child tracetest.SpanStub) {
	t.Helper()
	require.Equal(t, parent.TraceID(), child.SpanContext.TraceID(), "%s: trace", child.Name)
	require.Equal(t, parent.SpanID(), child.Parent.SpanID(), "%s: parent span", child.Name)
}

func attr(st tracetest.SpanStub, key string) (string, bool) {
	for _, a := range st.Attributes {
		if string(a.Key) == key {
			return a.Value.String(), true
		}
	}
	return "", false
}
