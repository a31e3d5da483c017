package consumer

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/trace"
)

// Header names a dead-lettered message carries, on every transport.
const (
	HeaderDLError     = "Justonce-Error"     // the last error
	HeaderDLAttempts  = "Justonce-Attempts"  // attempts made
	HeaderDLOrigin    = "Justonce-Origin"    // topic or subject it came from
	HeaderDLPartition = "Justonce-Partition" // Kafka partition
	HeaderDLOffset    = "Justonce-Offset"    // Kafka offset or stream sequence
	HeaderDLID        = "Justonce-Event-Id"  // the event ID, when known
	HeaderDLScope     = "Justonce-Scope"     // the ledger scope
	HeaderDLTime      = "Justonce-Failed-At" // RFC 3339 time of dead-lettering
)

// DeadLetterHeaders returns m's headers followed by the dead-letter headers
// describing why and where from. The producer's trace context, if m
// carries one, is kept as it is; DeadLetterHeadersContext points the dead
// letter at the handler run that failed instead.
func DeadLetterHeaders(scope string, m *Message, cause error) []Header {
	hs := make([]Header, 0, len(m.Headers)+8)
	hs = append(hs, m.Headers...)
	msg := "unknown"
	if cause != nil {
		msg = cause.Error()
	}
	hs = append(hs,
		Header{HeaderDLError, []byte(msg)},
		Header{HeaderDLAttempts, []byte(strconv.Itoa(m.Attempt))},
		Header{HeaderDLOrigin, []byte(m.Topic)},
		Header{HeaderDLPartition, []byte(strconv.Itoa(m.Partition))},
		Header{HeaderDLOffset, []byte(strconv.FormatInt(m.Offset, 10))},
		Header{HeaderDLScope, []byte(scope)},
		Header{HeaderDLTime, []byte(time.Now().UTC().Format(time.RFC3339Nano))},
	)
	if m.ID != "" {
		hs = append(hs, Header{HeaderDLID, []byte(m.ID)})
	}
	return hs
}

// DeadLetterHeadersContext is DeadLetterHeaders with the dead letter's
// trace context set to the span that failed: the span of the handler run
// whose error is cause (the tracing package's middleware attaches it to
// the errors it returns), else the span in ctx. The W3C trace context
// (traceparent, tracestate, or whatever the propagator writes) of that span
// replaces m's own, injected with otel.GetTextMapPropagator(), so that a
// consumer of the dead letter continues the trace as a child of the failed
// run, itself a child of the producer's span. m's baggage is kept.
//
// Without a span, or with the default no-op propagator, it returns what
// DeadLetterHeaders returns: m's trace headers stay as they came.
func DeadLetterHeadersContext(ctx context.Context, scope string, m *Message, cause error) []Header {
	hs := DeadLetterHeaders(scope, m, cause)
	sc := failedSpan(ctx, cause)
	prop := otel.GetTextMapPropagator()
	fields := prop.Fields()
	if !sc.IsValid() || len(fields) == 0 {
		return hs
	}
	c := headerCarrier(m.Headers)
	ctx = trace.ContextWithSpanContext(prop.Extract(ctx, &c), sc)
	c = headerCarrier(hs)
	for _, f := range fields {
		c.del(f)
	}
	prop.Inject(ctx, &c)
	return c
}

// failedSpan is the span context a dead letter points at: the one attached
// to cause, else ctx's.
func failedSpan(ctx context.Context, cause error) trace.SpanContext {
	var se interface{ SpanContext() trace.SpanContext }
	if errors.As(cause, &se) {
		if sc := se.SpanContext(); sc.IsValid() {
			return sc
		}
	}
	return trace.SpanContextFromContext(ctx)
}

// headerCarrier is a propagation.TextMapCarrier over headers (the tracing
// package exports the same as tracing.HeaderCarrier).
type headerCarrier []Header

func (c *headerCarrier) Get(key string) string {
	for _, h := range *c {
		if strings.EqualFold(h.Key, key) {
			return string(h.Value)
		}
	}
	return ""
}

func (c *headerCarrier) Set(key, value string) {
	c.del(key)
	*c = append(*c, Header{Key: key, Value: []byte(value)})
}

func (c *headerCarrier) Keys() []string {
	keys := make([]string, len(*c))
	for i, h := range *c {
		keys[i] = h.Key
	}
	return keys
}

// del removes the headers named key, without touching the array of the
// slice it was made from.
func (c *headerCarrier) del(key string) {
	hs := (*c)[:0:0]
	for _, h := range *c {
		if !strings.EqualFold(h.Key, key) {
			hs = append(hs, h)
		}
	}
	*c = hs
}
