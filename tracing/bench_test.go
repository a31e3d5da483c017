package tracing_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/tracing"
)

// BenchmarkMiddleware measures what the handler span costs per message,
// beside the bare handler in the same rounds: a span from a sampling SDK
// tracer provider (no exporter), and the same with the producer's
// traceparent extracted from the headers. It sizes its own work: rounds of
// 5,000 calls of each variant, alternated, until 2 s have passed per
// benchmark iteration. Reported: ns/msg of each, and what extracting the
// producer's context adds (span+parent minus span). The database is not involved: these are the CPU costs a handler
// that does real work (a transaction) hides.
func BenchmarkMiddleware(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	sp := &spans{tp: tp}
	_, hs := sp.produce("order-1")
	bare := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	prop := tracing.WithPropagator(propagation.TraceContext{})
	traced := tracing.Middleware(tp, "billing", prop)(bare)
	plainMsg := &consumer.Message{ID: "order-1", Topic: "orders", Headers: []consumer.Header{{Key: "ce_id", Value: []byte("order-1")}}}
	parentMsg := &consumer.Message{ID: "order-1", Topic: "orders", Headers: hs}
	ctx := context.Background()

	const perRound = 5000
	run := func(h consumer.Handler, m *consumer.Message) time.Duration {
		start := time.Now()
		for range perRound {
			_ = h(ctx, nil, m)
		}
		return time.Since(start)
	}
	var tBare, tSpan, tParent time.Duration
	var rounds int
	b.ResetTimer()
	for range b.N {
		end := time.Now().Add(2 * time.Second)
		for time.Now().Before(end) {
			tBare += run(bare, plainMsg)
			tSpan += run(traced, plainMsg)
			tParent += run(traced, parentMsg)
			rounds++
		}
	}
	n := float64(rounds * perRound)
	b.ReportMetric(float64(tBare.Nanoseconds())/n, "bare-ns/msg")
	b.ReportMetric(float64(tSpan.Nanoseconds())/n, "span-ns/msg")
	b.ReportMetric(float64(tParent.Nanoseconds())/n, "span+parent-ns/msg")
	b.ReportMetric(float64(tParent-tSpan)/n, "extract-ns/msg")
}
