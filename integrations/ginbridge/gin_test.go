package ginbridge_test

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/gin-gonic/gin"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/ginbridge"
	"github.com/justonce/justonce/integrations/internal/itest"
)

// The chain after the bridge runs once per key: a replay and a conflict
// abort it. Middleware before the bridge sees the status the client got,
// whoever answered, through gin's own writer.
func TestGinChainOnceAndOuterStatus(t *testing.T) {
	pool := itest.DB(t)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	require.NoError(t, err)

	gin.SetMode(gin.TestMode)
	var seen []int
	var after, handler atomic.Int32
	r := gin.New()
	r.Use(func(c *gin.Context) { // an access log, outside the bridge
		c.Next()
		seen = append(seen, c.Writer.Status())
	})
	r.POST("/orders",
		ginbridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})),
		func(c *gin.Context) { after.Add(1); c.Next() }, // runs inside the bridge
		func(c *gin.Context) {
			handler.Add(1)
			ctx := c.Request.Context()
			if _, err := httpbridge.Tx(ctx).Exec(ctx, `INSERT INTO orders (item) VALUES ('book')`); err != nil {
				c.String(http.StatusServiceUnavailable, err.Error())
				return
			}
			c.Status(http.StatusAccepted) // a status without a body
		})
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)

	for _, want := range []string{"202 ", "202 replayed "} {
		got, err := itest.Post(srv.URL+"/orders", "k1", `{"item":"book"}`)
		require.NoError(t, err)
		require.Equal(t, want, got.String())
	}
	conflict, err := itest.Post(srv.URL+"/orders", "k1", `{"item":"pen"}`)
	require.NoError(t, err)
	require.Equal(t, httpbridge.ProblemKeyReused, conflict.ProblemType)
	require.Equal(t, "application/problem+json", conflict.ContentType)

	require.Equal(t, int32(1), after.Load(), "the chain after the bridge ran once")
	require.Equal(t, int32(1), handler.Load())
	require.Equal(t, []int{202, 202, 422}, seen)
	var n int
	require.NoError(t, pool.QueryRow(t.Context(), `SELECT count(*) FROM orders`).Scan(&n))
	require.Equal(t, 1, n)
}

// A 5xx from the handler rolls back and frees the key: the retry runs.
func TestGinServerErrorFreesKey(t *testing.T) {
	pool := itest.DB(t)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	require.NoError(t, err)
	gin.SetMode(gin.TestMode)
	var calls atomic.Int32
	r := gin.New()
	r.POST("/orders", ginbridge.Middleware(bridge.Route(httpbridge.RouteConfig{Scope: "orders"})), func(c *gin.Context) {
		ctx := c.Request.Context()
		if _, err := httpbridge.Tx(ctx).Exec(ctx, `INSERT INTO orders (item) VALUES ('book')`); err != nil {
			c.String(http.StatusServiceUnavailable, err.Error())
			return
		}
		if calls.Add(1) == 1 {
			c.AbortWithStatusJSON(http.StatusBadGateway, gin.H{"error": "provider down"})
			return
		}
		c.JSON(http.StatusCreated, gin.H{"ok": true})
	})
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	for _, want := range []string{`502 {"error":"provider down"}`, `201 {"ok":true}`, `201 replayed {"ok":true}`} {
		got, err := itest.Post(srv.URL+"/orders", "k1", `{}`)
		require.NoError(t, err)
		require.Equal(t, want, got.String())
	}
	var n int
	require.NoError(t, pool.QueryRow(t.Context(), `SELECT count(*) FROM orders`).Scan(&n))
	require.Equal(t, 1, n, "the 502's insert was rolled back")
}
