// Package tracing puts an OpenTelemetry span around each handler run of
// the consumer runtime (Kafka, NATS or any other front).
package tracing

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// TracerName is the instrumentation name of the spans Middleware starts.
const TracerName = "github.com/justonce/justonce/tracing"

// SpanName is the name of the span around a handler run.
const SpanName = "justonce.handle"

// Middleware returns a consumer.Middleware that starts a span named
// SpanName around each handler run, a child of the span in the context the
// transport passes (if any). The span carries the scope, the topic or
// subject (messaging.destination.name), the masked event ID
// (messaging.message.id) and the attempt; a handler error or panic marks it
// failed. The handler runs inside the ledger's transaction, so the span
// covers the handler's own work: the ledger's claim and commit are around
// it, duplicates never reach it. A nil tp returns a middleware that does
// nothing.
//
//	cfg.Middleware = append(cfg.Middleware, tracing.Middleware(otel.GetTracerProvider(), cfg.Scope))
func Middleware(tp trace.TracerProvider, scope string) consumer.Middleware {
	if tp == nil {
		return func(h consumer.Handler) consumer.Handler { return h }
	}
	tracer := tp.Tracer(TracerName)
	return func(next consumer.Handler) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) (err error) {
			ctx, span := tracer.Start(ctx, SpanName,
				trace.WithSpanKind(trace.SpanKindInternal),
				trace.WithAttributes(
					attribute.String("justonce.scope", scope),
					attribute.String("messaging.destination.name", m.Topic),
					attribute.String("messaging.message.id", inbox.Mask(m.ID)),
					attribute.Int("justonce.attempt", m.Attempt),
				))
			defer func() {
				if v := recover(); v != nil {
					span.SetStatus(codes.Error, fmt.Sprint("panic: ", v))
					span.End()
					panic(v)
				}
				if err != nil {
					span.RecordError(err)
					span.SetStatus(codes.Error, err.Error())
				}
				span.End()
			}()
			return next(ctx, tx, m)
		}
	}
}
