package tracing_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/tracing"
)

func TestHeaderCarrier(t *testing.T) {
	orig := []consumer.Header{{Key: "ce_id", Value: []byte("1")}, {Key: "Traceparent", Value: []byte("old")}, {Key: "traceparent", Value: []byte("older")}}
	c := tracing.HeaderCarrier(orig)
	require.Equal(t, "old", c.Get("traceparent"), "first, case-insensitive")
	c.Set("traceparent", "new")
	require.Equal(t, []string{"ce_id", "traceparent"}, c.Keys(), "every old one replaced by one")
	require.Equal(t, "new", c.Get("TRACEPARENT"))
	require.Equal(t, "old", string(orig[1].Value), "the message's headers are not touched")
	require.Equal(t, "", c.Get("missing"))
}

// The dead letter keeps the producer's trace context when no span failed,
// and takes the failed run's when the cause carries one.
func TestDeadLetterHeadersContext(t *testing.T) {
	sp := newSpans(t)
	producer, hs := sp.produce("order-1")
	m := &consumer.Message{ID: "order-1", Topic: "orders", Headers: hs}
	tp := func(hs []consumer.Header) trace.SpanContext {
		c := tracing.HeaderCarrier(hs)
		return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), &c))
	}

	plain := consumer.DeadLetterHeadersContext(context.Background(), "billing", m, errors.New("boom"))
	require.Equal(t, producer.SpanID(), tp(plain).SpanID(), "no failed span: the producer's context stays")
	require.Equal(t, consumer.DeadLetterHeaders("billing", m, errors.New("boom"))[:len(hs)], plain[:len(hs)])

	h := tracing.Middleware(sp.tp, "billing")(func(context.Context, pgx.Tx, *consumer.Message) error {
		return errors.New("boom")
	})
	err := h(context.Background(), nil, m)
	run, ok := tracing.SpanContextOf(err)
	require.True(t, ok)
	require.Equal(t, "boom", err.Error(), "the error text is the handler's")
	wrapped := consumer.Permanent(err)
	got := consumer.DeadLetterHeadersContext(context.Background(), "billing", m, wrapped)
	require.Equal(t, run.SpanID(), tp(got).SpanID(), "the failed run's context")
	require.Equal(t, producer.TraceID(), tp(got).TraceID())
	n := 0
	for _, h := range got {
		if h.Key == "traceparent" {
			n++
		}
	}
	require.Equal(t, 1, n, "one traceparent")
	require.Equal(t, producer.SpanID(), tp(m.Headers).SpanID(), "the message's headers are not touched")

	// A span in ctx is used when the cause carries none.
	ctx := trace.ContextWithSpanContext(context.Background(), run)
	require.Equal(t, run.SpanID(), tp(consumer.DeadLetterHeadersContext(ctx, "billing", m, errors.New("x"))).SpanID())
}

func TestLogHandlerGroupsAndAttrs(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(tracing.LogHandler(slog.NewTextHandler(&buf, nil))).With("app", "shop")
	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid}))
	l.InfoContext(ctx, "x")
	require.Contains(t, buf.String(), "app=shop trace_id=4bf92f3577b34da6a3ce929d0e0e4736 span_id=00f067aa0ba902b7")
	require.Same(t, tracing.LogHandler(l.Handler()), l.Handler(), "not wrapped twice")
}

// A handler's own problem+json is "executed"; only the bridge's problem
// types name an outcome.
func TestHTTPOutcomeOfHandlerProblem(t *testing.T) {
	sp := newSpans(t)
	for _, tc := range []struct{ typ, want string }{
		{"https://example.com/problems/out-of-stock", tracing.OutcomeExecuted},
		{httpbridge.ProblemInProgress, "request-in-progress"},
	} {
		h := tracing.HTTP(sp.tp)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/problem+json; charset=utf-8")
			w.WriteHeader(http.StatusConflict)
			_, _ = io.WriteString(w, `{"type":"`+tc.typ+`","status":409}`)
		}))
		ctx, root := sp.tp.Tracer("t").Start(context.Background(), "root")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequestWithContext(ctx, http.MethodPost, "/x", nil))
		root.End()
		var server []tracetest.SpanStub
		for _, s := range sp.exp.GetSpans() {
			if s.SpanKind == trace.SpanKindServer && s.SpanContext.TraceID() == root.SpanContext().TraceID() {
				server = append(server, s)
			}
		}
		require.Len(t, server, 1)
		got, _ := attr(server[0], string(tracing.OutcomeKey))
		require.Equal(t, tc.want, got)
	}
}

// With a producer's context in the headers and a span in the transport's
// context, the parent is the producer's span and both are linked; without
// headers the parent is the context's span.
func TestMiddlewareParentAndLinks(t *testing.T) {
	sp := newSpans(t)
	producer, hs := sp.produce("order-1")
	ctx, ambient := sp.tp.Tracer("t").Start(context.Background(), "fetch")
	ambient.End()
	h := tracing.Middleware(sp.tp, "billing")(func(context.Context, pgx.Tx, *consumer.Message) error { return nil })

	require.NoError(t, h(ctx, nil, &consumer.Message{ID: "order-1", Headers: hs}))
	withHeaders := sp.await(t, tracing.SpanName, producer.TraceID(), 1)[0]
	requireChild(t, producer, withHeaders)
	require.Len(t, withHeaders.Links, 2)
	require.Equal(t, producer.SpanID(), withHeaders.Links[0].SpanContext.SpanID())
	require.Equal(t, ambient.SpanContext().SpanID(), withHeaders.Links[1].SpanContext.SpanID())

	require.NoError(t, h(ctx, nil, &consumer.Message{ID: "order-2"}))
	plain := sp.await(t, tracing.SpanName, ambient.SpanContext().TraceID(), 1)[0]
	requireChild(t, ambient.SpanContext(), plain)
	require.Empty(t, plain.Links)
}

func TestNilProviderDoesNothing(t *testing.T) {
	rec := httptest.NewRecorder()
	ran := false
	tracing.HTTP(nil)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran = true
		require.Same(t, rec, w, "the writer is not wrapped")
		require.False(t, trace.SpanContextFromContext(r.Context()).IsValid(), "no span")
	})).ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/", nil))
	require.True(t, ran)
}
