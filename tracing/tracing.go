// Package tracing connects justonce to OpenTelemetry: a span around each
// handler run of the consumer runtime, a child of the producer's span when
// the message carries a W3C trace context (traceparent, tracestate); a
// server span for HTTP routes of the bridge with the bridge's outcome; and
// a log handler that stamps records with their trace.
//
// Middleware and HTTP take the application's tracer provider
// (otel.GetTracerProvider() for the global one; nil turns them off). Trace
// context is read and written through a propagation.TextMapPropagator, by
// default the global one (otel.GetTextMapPropagator), which propagates
// nothing until the application sets one:
//
//	otel.SetTextMapPropagator(propagation.TraceContext{})
//
// A dead letter points at the handler run that failed last: the fronts
// build its headers with consumer.DeadLetterHeadersContext, which finds
// that run's span in the error Middleware returns.
package tracing

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// TracerName is the instrumentation name of the spans Middleware starts.
const TracerName = "github.com/justonce/justonce/tracing"

// SpanName is the name of the span around a handler run.
const SpanName = "justonce.handle"

// Option configures Middleware and HTTP.
type Option func(*options)

type options struct {
	prop         propagation.TextMapPropagator
	replayHeader string
	http         []otelhttp.Option
}

func newOptions(opts []Option) options {
	o := options{replayHeader: "Idempotent-Replayed"}
	for _, opt := range opts {
		opt(&o)
	}
	if o.prop == nil {
		o.prop = otel.GetTextMapPropagator()
	}
	return o
}

// WithPropagator sets the propagator that reads the producer's trace
// context from message headers (Middleware) or request headers (HTTP).
// Default: otel.GetTextMapPropagator(), read when the middleware is made;
// the global propagator follows a later otel.SetTextMapPropagator.
func WithPropagator(p propagation.TextMapPropagator) Option {
	return func(o *options) { o.prop = p }
}

// Middleware returns a consumer.Middleware that starts a span named
// SpanName around each handler run.
//
// The span's parent is the producer's span when the message's headers
// carry a trace context (read with the propagator, see WithPropagator),
// as the OpenTelemetry messaging conventions allow for a message
// processed on its own; the span also links to it. Without one, the
// parent is the span in the context the transport passes, if any (with a
// producer's context, that span is linked instead). The span is of kind
// consumer and carries the scope, the topic or subject
// (messaging.destination.name), the masked event ID (messaging.message.id),
// the attempt, and messaging.operation.type "process". A handler error or
// panic marks it failed.
//
// The handler runs inside the ledger's transaction, so the span covers the
// handler's own work: the ledger's claim and commit are around it,
// duplicates never reach it. Each attempt is a span of its own, all
// children of the producer's span.
//
// A handler error is returned wrapped (errors.Is and errors.As see through
// it, its text is unchanged) with the span's context, so that
// consumer.DeadLetterHeadersContext can make the dead letter a child of the
// handler run that failed. A nil tp returns a middleware that does nothing.
//
//	cfg.Middleware = append(cfg.Middleware, tracing.Middleware(otel.GetTracerProvider(), cfg.Scope))
func Middleware(tp trace.TracerProvider, scope string, opts ...Option) consumer.Middleware {
	if tp == nil {
		return func(h consumer.Handler) consumer.Handler { return h }
	}
	o := newOptions(opts)
	tracer := tp.Tracer(TracerName)
	return func(next consumer.Handler) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) (err error) {
			pctx, links := parent(ctx, o.prop, m)
			ctx, span := tracer.Start(pctx, SpanName,
				trace.WithSpanKind(trace.SpanKindConsumer),
				trace.WithLinks(links...),
				trace.WithAttributes(
					attribute.String("justonce.scope", scope),
					attribute.String("messaging.operation.type", "process"),
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
					err = &spanError{err: err, sc: span.SpanContext()}
				}
				span.End()
			}()
			return next(ctx, tx, m)
		}
	}
}

// parent returns the context a handler span starts from, and its links:
// the producer's trace context from m's headers when there is one (linked
// too, and the span already in ctx linked), else ctx.
func parent(ctx context.Context, prop propagation.TextMapPropagator, m *consumer.Message) (context.Context, []trace.Link) {
	if len(m.Headers) == 0 {
		return ctx, nil
	}
	c := HeaderCarrier(m.Headers)
	pctx := prop.Extract(ctx, &c)
	producer := trace.SpanContextFromContext(pctx)
	ambient := trace.SpanContextFromContext(ctx)
	if !producer.IsValid() || producer.Equal(ambient) {
		return ctx, nil
	}
	links := []trace.Link{{SpanContext: producer}}
	if ambient.IsValid() {
		links = append(links, trace.Link{SpanContext: ambient})
	}
	return pctx, links
}

// spanError is a handler error with the span of the run that returned it.
type spanError struct {
	err error
	sc  trace.SpanContext
}

func (e *spanError) Error() string { return e.err.Error() }
func (e *spanError) Unwrap() error { return e.err }

// SpanContext is the span of the handler run that failed; see
// consumer.DeadLetterHeadersContext.
func (e *spanError) SpanContext() trace.SpanContext { return e.sc }

// SpanContextOf returns the span context of the handler run that returned
// err, when Middleware traced it, and false otherwise.
func SpanContextOf(err error) (trace.SpanContext, bool) {
	var se *spanError
	if errors.As(err, &se) {
		return se.sc, true
	}
	return trace.SpanContext{}, false
}
