package tracing

import (
	"bytes"
	"encoding/json"
	"mime"
	"net/http"
	"strings"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/httpbridge"
)

// OutcomeKey is the span attribute HTTP sets to what the bridge did with
// the request:
//
//   - "executed": the handler's own response (it ran now, or the route
//     does not cover the request);
//   - "replayed": a stored response, replayed (the response carries the
//     replay header);
//   - otherwise the last segment of the type of the problem the bridge
//     answered itself (httpbridge.Problem...): "key-reused" (422, the key
//     came with another request), "request-in-progress" (409),
//     "invalid-key", "missing-key", "store-unavailable", and so on.
const OutcomeKey = attribute.Key("justonce.http.outcome")

// Outcomes HTTP records besides the problem types.
const (
	OutcomeExecuted = "executed"
	OutcomeReplayed = "replayed"
)

// problemPrefix is what the type of every problem the bridge answers
// itself starts with.
var problemPrefix = strings.TrimSuffix(httpbridge.ProblemMissingKey, "missing-key")

// maxProblemPeek caps the bytes of a problem+json body read for its type.
const maxProblemPeek = 4096

// WithReplayHeader names the response header the bridge marks replays
// with, when httpbridge.Config.ReplayHeader is not the default
// "Idempotent-Replayed". HTTP only.
func WithReplayHeader(name string) Option {
	return func(o *options) { o.replayHeader = name }
}

// WithHTTPOptions passes options to the otelhttp handler HTTP is made of
// (a span name formatter, filters, a meter provider, ...). HTTP only.
func WithHTTPOptions(opts ...otelhttp.Option) Option {
	return func(o *options) { o.http = append(o.http, opts...) }
}

// HTTP returns net/http server middleware that follows the OpenTelemetry
// HTTP semantic conventions (it is otelhttp's handler: a server span per
// request, a child of the caller's span when the request carries a trace
// context, named "{method} {route}" with http.route when the standard mux
// sets a pattern, else "{method}") and adds the bridge's outcome
// (OutcomeKey) to the span. Put it outside the bridge's route:
//
//	mux.Handle("POST /orders", tracing.HTTP(tp)(bridge.Route(rc)(createOrder)))
//
// The handler's context carries the server span, so the spans it starts,
// and its logs through LogHandler, belong to the request's trace. otelhttp
// also records the HTTP server metrics through otel.GetMeterProvider() (a
// no-op until the application sets one; see WithHTTPOptions). A nil tp
// returns a middleware that does nothing, as Middleware does.
func HTTP(tp trace.TracerProvider, opts ...Option) func(http.Handler) http.Handler {
	if tp == nil {
		return func(h http.Handler) http.Handler { return h }
	}
	o := newOptions(opts)
	hopts := []otelhttp.Option{otelhttp.WithPropagators(o.prop), otelhttp.WithTracerProvider(tp)}
	server := otelhttp.NewMiddleware(SpanName, append(hopts, o.http...)...)
	return func(next http.Handler) http.Handler {
		return server(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ow := &outcomeWriter{ResponseWriter: w, replayHeader: o.replayHeader}
			next.ServeHTTP(ow, r)
			if span := trace.SpanFromContext(r.Context()); span.IsRecording() {
				span.SetAttributes(OutcomeKey.String(ow.outcome()))
			}
		}))
	}
}

// outcomeWriter notes what the response says about the bridge's outcome:
// the replay header, and the type of a problem+json body.
type outcomeWriter struct {
	http.ResponseWriter
	replayHeader string
	wrote        bool
	replayed     bool
	problem      bool // the response is application/problem+json
	peek         bytes.Buffer
}

func (w *outcomeWriter) WriteHeader(code int) {
	if !w.wrote {
		w.wrote = true
		h := w.Header()
		w.replayed = h.Get(w.replayHeader) == "true"
		if mt, _, err := mime.ParseMediaType(h.Get("Content-Type")); err == nil && mt == "application/problem+json" {
			w.problem = true
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *outcomeWriter) Write(p []byte) (int, error) {
	if !w.wrote {
		w.WriteHeader(http.StatusOK)
	}
	if w.problem && w.peek.Len() < maxProblemPeek {
		w.peek.Write(p[:min(len(p), maxProblemPeek-w.peek.Len())])
	}
	return w.ResponseWriter.Write(p)
}

// Unwrap gives http.ResponseController the writer underneath.
func (w *outcomeWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *outcomeWriter) outcome() string {
	if w.replayed {
		return OutcomeReplayed
	}
	if w.problem {
		var p struct {
			Type string `json:"type"`
		}
		if json.Unmarshal(w.peek.Bytes(), &p) == nil && strings.HasPrefix(p.Type, problemPrefix) {
			return strings.TrimPrefix(p.Type, problemPrefix)
		}
	}
	return OutcomeExecuted
}
