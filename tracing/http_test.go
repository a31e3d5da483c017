package tracing_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/tracing"
)

// An HTTP route of the bridge behind tracing.HTTP, against real Postgres:
// each request's server span is the child of the client's span, carries
// the bridge's outcome (executed, replayed, key-reused), and the handler's
// own span is the server span's child; a replay runs no handler.
func TestHTTPTraceOutcome(t *testing.T) {
	sp := newSpans(t)
	pg := testsvc.Postgres(t)
	pg.Exec(t, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	require.NoError(t, err)
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, span := sp.tp.Tracer("test-handler").Start(r.Context(), "insert order")
		defer span.End()
		var id int64
		if err := httpbridge.Tx(ctx).QueryRow(ctx, `INSERT INTO orders (item) VALUES ('book') RETURNING id`).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, id)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", tracing.HTTP(sp.tp)(
		bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})(createOrder)))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	client := &http.Client{Transport: otelhttp.NewTransport(http.DefaultTransport, otelhttp.WithTracerProvider(sp.tp))}

	post := func(body, key string) (trace.SpanContext, int, string) {
		ctx, span := sp.tp.Tracer("test-client").Start(context.Background(), "place order")
		defer span.End()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return span.SpanContext(), resp.StatusCode, resp.Header.Get("Content-Type")
	}

	for _, tc := range []struct {
		body, outcome, ctype string
		status               int
		ran                  bool
	}{
		{`{"item":"book"}`, tracing.OutcomeExecuted, "", http.StatusCreated, true},
		{`{"item":"book"}`, tracing.OutcomeReplayed, "", http.StatusCreated, false},
		{`{"item":"pen"}`, "key-reused", "application/problem+json", http.StatusUnprocessableEntity, false},
	} {
		root, status, ctype := post(tc.body, "key-1")
		require.Equal(t, tc.status, status, tc.outcome)
		if tc.ctype != "" {
			require.Equal(t, tc.ctype, ctype)
		}
		// The transport's client span under root, the server span under it.
		var server, clientHTTP *tracetest.SpanStub
		testsvc.Eventually(t, 10*time.Second, func() bool {
			server, clientHTTP = nil, nil
			for _, s := range sp.exp.GetSpans() {
				switch {
				case s.SpanContext.TraceID() != root.TraceID():
				case s.SpanKind == trace.SpanKindClient:
					clientHTTP = &s
				case s.SpanKind == trace.SpanKindServer:
					server = &s
				}
			}
			return server != nil && clientHTTP != nil
		}, "client and server spans of %s", tc.outcome)
		requireChild(t, root, *clientHTTP)
		requireChild(t, clientHTTP.SpanContext, *server)
		require.True(t, server.Parent.IsRemote())
		got, _ := attr(*server, string(tracing.OutcomeKey))
		require.Equal(t, tc.outcome, got)
		route, _ := attr(*server, "http.route")
		require.Equal(t, "/orders", route)
		inserts := sp.where("insert order", root.TraceID())
		if tc.ran {
			require.Len(t, inserts, 1)
			requireChild(t, server.SpanContext, inserts[0])
		} else {
			require.Empty(t, inserts, "the handler did not run for a %s request", tc.outcome)
		}
	}
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM orders`))
}
