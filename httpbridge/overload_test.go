package httpbridge_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
)

// With every connection of the ledger's pool in use for longer than
// Config.AcquireWait, a request is shed: 503 overloaded with Retry-After,
// on a transactional route, a lease-mode route and a keyless request
// alike; the handler did not run and nothing was recorded, so the same
// key, sent again once a connection is free, runs once.
func TestOverloadShedsWith503(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{cfg: httpbridge.Config{AcquireWait: 50 * time.Millisecond}, pg: []testsvc.PGOption{testsvc.MaxConns(1)}})
	a := &app{}
	tx := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
	ran := 0
	leased := b.bridge.Route(httpbridge.RouteConfig{Scope: "calls", Lease: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran++
		w.WriteHeader(http.StatusCreated)
	}))

	ctx := context.Background()
	held, err := b.pg.Pool.Acquire(ctx)
	require.NoError(t, err)
	for name, r := range map[string]response{
		"tx":      post(tx, "k1", `{"n":1}`),
		"lease":   post(leased, "k2", `{"n":2}`),
		"keyless": serve(tx, http.MethodPost, "/orders", `{"n":3}`, "Content-Type", "application/json"),
	} {
		p := requireProblem(t, r, http.StatusServiceUnavailable, httpbridge.ProblemOverloaded)
		require.Equal(t, "Server overloaded", p.Title, name)
		require.Equal(t, "1", r.Header.Get("Retry-After"), name)
		require.Empty(t, r.Header.Get("Idempotency-Key-Expires"), name)
	}
	require.Zero(t, a.runs.Load())
	require.Zero(t, ran)
	require.EqualValues(t, 2, b.ledger.Counters().Overloaded) // the keyless request is not a ledger call
	held.Release()

	first := post(tx, "k1", `{"n":1}`)
	require.Equal(t, http.StatusCreated, first.Code, "%s", first.Body)
	again := post(tx, "k1", `{"n":1}`)
	require.True(t, again.replayed())
	require.Equal(t, http.StatusCreated, post(leased, "k2", `{"n":2}`).Code)
	require.EqualValues(t, 1, a.runs.Load())
	require.Equal(t, 1, ran)
	require.Equal(t, 1, b.orders(t))
}

func TestAcquireWaitNegativeIsRefused(t *testing.T) {
	_, err := httpbridge.New(httpbridge.Config{Ledger: deadLedger(t), AcquireWait: -1})
	require.ErrorContains(t, err, "AcquireWait is negative")
}
