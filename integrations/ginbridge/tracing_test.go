package ginbridge_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/ginbridge"
	"github.com/justonce/justonce/integrations/internal/itest"
	"github.com/justonce/justonce/tracing"
)

// Middleware adapts any net/http middleware: tracing.HTTP before the
// bridge gives each request a server span with the bridge's outcome.
func TestGinWithTracing(t *testing.T) {
	pool := itest.DB(t)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	require.NoError(t, err)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))

	gin.SetMode(gin.TestMode)
	r := gin.New()
	r.POST("/orders",
		ginbridge.Middleware(tracing.HTTP(tp)),
		ginbridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})),
		func(c *gin.Context) {
			if trace.SpanContextFromContext(c.Request.Context()).IsValid() {
				c.String(http.StatusCreated, "traced")
				return
			}
			c.String(http.StatusCreated, "untraced")
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
	got, err := itest.Post(srv.URL+"/orders", "k2", `{}`)
	require.NoError(t, err)
	require.Equal(t, "201 traced", got.String(), "the handler's context carries the server span")
}
