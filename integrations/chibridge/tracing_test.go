package chibridge_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/internal/itest"
	"github.com/justonce/justonce/tracing"
)

// tracing.HTTP in front of the bridge in chi's With: a server span per
// request with the bridge's outcome.
func TestChiWithTracing(t *testing.T) {
	pool := itest.DB(t)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	require.NoError(t, err)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))

	r := chi.NewRouter()
	r.With(tracing.HTTP(tp), bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})).
		Post("/orders", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
		})
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)

	var outcomes []string
	for _, body := range []string{`{"item":"book"}`, `{"item":"book"}`, `{"item":"pen"}`} {
		_, err := itest.Post(srv.URL+"/orders", "k1", body)
		require.NoError(t, err)
		spans := exp.GetSpans()
		s := spans[len(spans)-1]
		require.Equal(t, trace.SpanKindServer, s.SpanKind)
		for _, a := range s.Attributes {
			if a.Key == tracing.OutcomeKey {
				outcomes = append(outcomes, a.Value.AsString())
			}
		}
	}
	require.Equal(t, []string{"executed", "replayed", "key-reused"}, outcomes)
}
