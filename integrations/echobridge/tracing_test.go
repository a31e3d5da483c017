package echobridge_test

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/labstack/echo/v4"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/echobridge"
	"github.com/justonce/justonce/integrations/internal/itest"
	"github.com/justonce/justonce/tracing"
)

// Middleware adapts any net/http middleware: tracing.HTTP outside the
// bridge records the bridge's outcome, and the status of an error the
// handler returned (rendered inside, so the span sees it).
func TestEchoWithTracing(t *testing.T) {
	pool := itest.DB(t)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	require.NoError(t, err)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))

	e := echo.New()
	e.POST("/orders", func(c echo.Context) error {
		if c.Request().Header.Get("X-Fail") != "" {
			return echo.NewHTTPError(http.StatusServiceUnavailable)
		}
		return c.String(http.StatusCreated, "ok")
	}, echobridge.Middleware(tracing.HTTP(tp)),
		echobridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})))
	srv := httptest.NewServer(e)
	t.Cleanup(srv.Close)

	last := func() (string, string) {
		spans := exp.GetSpans()
		s := spans[len(spans)-1]
		require.Equal(t, trace.SpanKindServer, s.SpanKind)
		var outcome, status string
		for _, a := range s.Attributes {
			switch a.Key {
			case tracing.OutcomeKey:
				outcome = a.Value.AsString()
			case "http.response.status_code":
				status = a.Value.String()
			}
		}
		return outcome, status
	}
	for _, want := range [][2]string{{"executed", "201"}, {"replayed", "201"}} {
		_, err := itest.Post(srv.URL+"/orders", "k1", `{}`)
		require.NoError(t, err)
		o, s := last()
		require.Equal(t, want, [2]string{o, s})
	}
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", nil)
	req.Header.Set("Idempotency-Key", "k2")
	req.Header.Set("X-Fail", "1")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	o, s := last()
	require.Equal(t, [2]string{"executed", "503"}, [2]string{o, s})
}
