package metrics_test

import (
	"context"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/justonce/justonce/inbox"
)

// samples gathers reg and returns every sample as `name{k="v",...}` ->
// value; a histogram gives name_count{...} and name_sum{...}.
func samples(t *testing.T, reg prometheus.Gatherer) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, lp := range m.GetLabel() {
				ls = append(ls, lp.GetName()+"="+`"`+lp.GetValue()+`"`)
			}
			sort.Strings(ls)
			labels := ""
			if len(ls) > 0 {
				labels = "{" + strings.Join(ls, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[mf.GetName()+labels] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[mf.GetName()+labels] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[mf.GetName()+"_count"+labels] = float64(m.GetHistogram().GetSampleCount())
				out[mf.GetName()+"_sum"+labels] = m.GetHistogram().GetSampleSum()
			}
		}
	}
	return out
}

// only keeps the samples whose name starts with one of prefixes.
func only(all map[string]float64, prefixes ...string) map[string]float64 {
	out := map[string]float64{}
	for k, v := range all {
		for _, p := range prefixes {
			if strings.HasPrefix(k, p) {
				out[k] = v
			}
		}
	}
	return out
}

func result(res inbox.Result) inbox.TxFunc {
	return func(context.Context, pgx.Tx) (inbox.Result, error) { return res, nil }
}

// recorder is a trace.TracerProvider that keeps the spans it starts.
type recorder struct {
	embedded.TracerProvider
	mu    sync.Mutex
	spans []*span
}

func (r *recorder) Tracer(name string, _ ...trace.TracerOption) trace.Tracer {
	return &tracer{r: r, name: name}
}

func (r *recorder) ended() []*span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*span
	for _, s := range r.spans {
		if s.ended {
			out = append(out, s)
		}
	}
	return out
}

type tracer struct {
	embedded.Tracer
	r    *recorder
	name string
}

func (t *tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	cfg := trace.NewSpanStartConfig(opts...)
	s := &span{tracer: t.name, name: name, kind: cfg.SpanKind(), attrs: map[attribute.Key]attribute.Value{}}
	for _, kv := range cfg.Attributes() {
		s.attrs[kv.Key] = kv.Value
	}
	t.r.mu.Lock()
	t.r.spans = append(t.r.spans, s)
	t.r.mu.Unlock()
	return trace.ContextWithSpan(ctx, s), s
}

type span struct {
	noop.Span
	tracer, name string
	kind         trace.SpanKind
	attrs        map[attribute.Key]attribute.Value
	status       codes.Code
	errs         []error
	ended        bool
}

func (s *span) End(...trace.SpanEndOption)                    { s.ended = true }
func (s *span) SetStatus(c codes.Code, _ string)              { s.status = c }
func (s *span) RecordError(err error, _ ...trace.EventOption) { s.errs = append(s.errs, err) }
func (s *span) IsRecording() bool                             { return true }
