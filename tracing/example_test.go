package tracing_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
	"github.com/justonce/justonce/tracing"
)

// Trace each handler run with the application's tracer provider.
func ExampleMiddleware() {
	tp := noop.NewTracerProvider() // the application's: otel.GetTracerProvider()
	handle := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		// The span is in ctx: trace.SpanFromContext(ctx).
		return nil
	}
	cfg := consumer.Config{
		Scope:      "billing",
		Middleware: []consumer.Middleware{tracing.Middleware(tp, "billing")},
	}
	_ = cfg // with Ledger: consumer.New(cfg, handle)

	traced := tracing.Middleware(tp, "billing")(handle)
	fmt.Println(traced(context.Background(), nil, &consumer.Message{ID: "evt-1"}))
	// Output: <nil>
}

// A message published in a producer's span carries its W3C trace context
// (traceparent) in its headers; the handler's span is that span's child.
func ExampleMiddleware_producerParent() {
	otel.SetTextMapPropagator(propagation.TraceContext{}) // once, at start-up
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))

	// The producer: inject the span's context into the message's headers.
	ctx, producer := tp.Tracer("shop").Start(context.Background(), "orders publish",
		trace.WithSpanKind(trace.SpanKindProducer))
	headers := tracing.HeaderCarrier{{Key: "ce_id", Value: []byte("order-1")}}
	otel.GetTextMapPropagator().Inject(ctx, &headers)
	producer.End()
	fmt.Println("headers:", strings.Join(headers.Keys(), ", "))

	// The consumer (the runtime calls the handler through the middleware).
	handle := tracing.Middleware(tp, "billing")(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return nil
	})
	_ = handle(context.Background(), nil, &consumer.Message{ID: "order-1", Topic: "orders", Headers: headers})

	span := exp.GetSpans()[1]
	fmt.Println(span.Name, span.SpanKind)
	fmt.Println("child of the producer:", span.Parent.SpanID() == producer.SpanContext().SpanID())
	// Output:
	// headers: ce_id, traceparent
	// justonce.handle consumer
	// child of the producer: true
}

// A message that fails for good is dead-lettered with its failed run's
// trace context: whoever consumes the dead letter continues that trace.
func ExampleSpanContextOf() {
	otel.SetTextMapPropagator(propagation.TraceContext{}) // once, at start-up
	tp := sdktrace.NewTracerProvider()
	handle := tracing.Middleware(tp, "billing")(func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return consumer.Permanent(errors.New("card declined"))
	})
	m := &consumer.Message{ID: "order-1", Topic: "orders"}
	err := handle(context.Background(), nil, m)
	run, _ := tracing.SpanContextOf(err)
	fmt.Println(err, consumer.IsPermanent(err))

	// The dead letter's headers, as the fronts build them with DeadLetterHeadersContext.
	dl := tracing.HeaderCarrier(consumer.DeadLetterHeadersContext(context.Background(), "billing", m, err))
	fmt.Println("dead letter points at the failed run:", strings.Contains(dl.Get("traceparent"), run.SpanID().String()))
	// Output:
	// card declined true
	// dead letter points at the failed run: true
}

// Logs carry the trace of the context they are logged with.
func ExampleLogHandler() {
	noTime := func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	logger := slog.New(tracing.LogHandler(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{ReplaceAttr: noTime})))

	tid, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	sid, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ctx := trace.ContextWithSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}))

	logger.InfoContext(ctx, "charged", "order", "order-1")
	logger.Info("no context, no trace")
	// Output:
	// level=INFO msg=charged order=order-1 trace_id=4bf92f3577b34da6a3ce929d0e0e4736 span_id=00f067aa0ba902b7
	// level=INFO msg="no context, no trace"
}

// An HTTP route of the bridge with a server span per request, following
// the OpenTelemetry HTTP conventions, and the bridge's outcome on it.
// DATABASE_URL points at any Postgres (the tests set it to the local one).
func ExampleHTTP() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrations.New(pool, migrations.Config{Schema: "justonce"}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	ledger, err := inbox.New(pool, inbox.Config{Schema: "justonce"})
	if err != nil {
		log.Fatal(err)
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		log.Fatal(err)
	}
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)) // the application's

	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// r.Context() carries the server span; httpbridge.Tx(r.Context()) the transaction.
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"order":1}`)
	})
	orders := bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", tracing.HTTP(tp)(orders(createOrder)))

	srv := httptest.NewServer(mux)
	defer srv.Close()
	key := uuid.NewString()
	for _, body := range []string{`{"item":"book"}`, `{"item":"book"}`, `{"item":"pen"}`} {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		spans := exp.GetSpans()
		span := spans[len(spans)-1]
		for _, a := range span.Attributes {
			if a.Key == tracing.OutcomeKey {
				fmt.Println(resp.StatusCode, span.Name, a.Value.AsString())
			}
		}
	}
	// Output:
	// 201 POST /orders executed
	// 201 POST /orders replayed
	// 422 POST /orders key-reused
}
