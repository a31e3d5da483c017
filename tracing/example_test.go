package tracing_test

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/justonce/justonce/consumer"
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
