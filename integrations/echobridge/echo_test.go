package echobridge_test

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/labstack/echo/v4"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/echobridge"
	"github.com/justonce/justonce/integrations/internal/itest"
)

// An error the handler returns is rendered inside the bridge: a 5xx rolls
// the handler's write back and frees the key (the retry runs and succeeds),
// a 4xx is stored and replayed. With echo.WrapMiddleware the bridge would
// store an empty 200 for both and commit the write.
func TestEchoHandlerErrors(t *testing.T) {
	for _, tc := range []struct {
		name     string
		adapt    func(func(http.Handler) http.Handler) echo.MiddlewareFunc
		wantFail string // the first answer
		wantNext string // the retry's
		rows     int
	}{
		{"echobridge", echobridge.Middleware, "503 {\"message\":\"Service Unavailable\"}", "201 created", 1},
		// The client gets an empty 200, stored, and the write committed.
		{"WrapMiddleware", echo.WrapMiddleware, "200 ", "200 replayed ", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := itest.DB(t)
			ledger, err := inbox.New(pool, inbox.Config{})
			require.NoError(t, err)
			bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
			require.NoError(t, err)
			var calls atomic.Int32
			e := echo.New()
			e.POST("/orders", func(c echo.Context) error {
				ctx := c.Request().Context()
				if _, err := httpbridge.Tx(ctx).Exec(ctx, `INSERT INTO orders (item) VALUES ('book')`); err != nil {
					return err
				}
				if calls.Add(1) == 1 {
					return echo.NewHTTPError(http.StatusServiceUnavailable)
				}
				return c.String(http.StatusCreated, "created")
			}, tc.adapt(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})))
			srv := httptest.NewServer(e)
			t.Cleanup(srv.Close)

			first, err := itest.Post(srv.URL+"/orders", "k1", `{}`)
			require.NoError(t, err)
			require.Equal(t, tc.wantFail, first.String())
			next, err := itest.Post(srv.URL+"/orders", "k1", `{}`)
			require.NoError(t, err)
			require.Equal(t, tc.wantNext, next.String())
			var n int
			require.NoError(t, pool.QueryRow(t.Context(), `SELECT count(*) FROM orders`).Scan(&n))
			require.Equal(t, tc.rows, n)
		})
	}
}

// A 4xx error is stored: the retry replays it without running the handler;
// a plain error is a 500 and leaves the key free.
func TestEchoStoredClientErrorAndPlainError(t *testing.T) {
	pool := itest.DB(t)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	require.NoError(t, err)
	var calls atomic.Int32
	e := echo.New()
	idempotent := echobridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true}))
	e.POST("/invalid", func(c echo.Context) error {
		calls.Add(1)
		return echo.NewHTTPError(http.StatusBadRequest, "no such item")
	}, idempotent)
	e.POST("/broken", func(c echo.Context) error {
		calls.Add(1)
		return errors.New("boom")
	}, idempotent)
	srv := httptest.NewServer(e)
	t.Cleanup(srv.Close)

	for _, want := range []string{`400 {"message":"no such item"}`, `400 replayed {"message":"no such item"}`} {
		got, err := itest.Post(srv.URL+"/invalid", "k-invalid", `{}`)
		require.NoError(t, err)
		require.Equal(t, want, got.String())
	}
	require.Equal(t, int32(1), calls.Load())
	for range 2 {
		got, err := itest.Post(srv.URL+"/broken", "k-broken", `{}`)
		require.NoError(t, err)
		require.Equal(t, `500 {"message":"Internal Server Error"}`, got.String())
	}
	require.Equal(t, int32(3), calls.Load(), "a 500 leaves the key free: the retry ran")
}
