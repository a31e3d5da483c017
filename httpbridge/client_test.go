package httpbridge_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/httpretry"
)

// TestTransportAgainstBridge: the client and the server side together; a
// 409 while the first attempt runs turns into the replay.
func TestTransportAgainstBridge(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{cfg: httpbridge.Config{RetryAfter: time.Millisecond}})
	a := &app{}
	srv := httptest.NewServer(b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})(a))
	defer srv.Close()
	c := &http.Client{Transport: &httpretry.Transport{Base: srv.Client().Transport, Backoff: backoff.Backoff{Initial: 5 * time.Millisecond}}}
	resp, err := c.Post(srv.URL+"/orders", "application/json", strings.NewReader(`{"x":1}`))
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode, "%s", body)
	require.EqualValues(t, 1, a.runs.Load())
}

// TestTransportAgainstBridgeWithAltHeader: a client that names its key
// X-Idempotency-Key keeps it through the retrying transport, and the
// bridge dedupes on it.
func TestTransportAgainstBridgeWithAltHeader(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{cfg: httpbridge.Config{RetryAfter: time.Millisecond}})
	a := &app{}
	srv := httptest.NewServer(b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})(a))
	defer srv.Close()
	c := &http.Client{Transport: &httpretry.Transport{Base: srv.Client().Transport, Backoff: backoff.Backoff{Initial: 5 * time.Millisecond}}}
	for range 2 {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"x":1}`))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Idempotency-Key", "alt-1")
		resp, err := c.Do(req)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode, "%s", body)
	}
	require.EqualValues(t, 1, a.runs.Load(), "the second request is a replay")
}
