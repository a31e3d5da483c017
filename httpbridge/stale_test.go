package httpbridge_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

// TestStoredResponseExpires: past the route's ResultTTL a retry does not
// run the handler again and gets 422 response-expired (with the replay
// and expiry headers and when the operation completed); another request
// under the key is still key-reused; the janitor clears the stored body.
func TestStoredResponseExpires(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", ResultTTL: 500 * time.Millisecond})(a)

		first := post(h, "k-1", `{"item":"book"}`)
		require.Equal(t, http.StatusCreated, first.Code)
		again := post(h, "k-1", `{"item":"book"}`)
		require.True(t, again.replayed())
		sameResponse(t, first, again)

		var late response
		testsvc.Eventually(t, 10*time.Second, func() bool {
			late = post(h, "k-1", `{"item":"book"}`)
			if late.Code == http.StatusCreated {
				sameResponse(t, first, late)
				return false
			}
			return true
		}, "the stored response expires")
		requireProblem(t, late, http.StatusUnprocessableEntity, httpbridge.ProblemResponseExpired)
		require.True(t, late.replayed())
		require.NotEmpty(t, late.Header.Get("Idempotency-Key-Expires"))
		require.Equal(t, "no-store", late.Header.Get("Cache-Control"))
		var p struct {
			CompletedAt time.Time `json:"completed_at"`
		}
		require.NoError(t, json.Unmarshal(late.Body, &p))
		require.WithinDuration(t, time.Now(), p.CompletedAt, time.Minute)

		reused := post(h, "k-1", `{"item":"pen"}`)
		requireProblem(t, reused, http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
		require.EqualValues(t, 1, a.runs.Load(), "the handler never ran again")
		require.Equal(t, 1, b.orders(t))

		require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE response_body IS NOT NULL`))
		_, err := b.ledger.Purge(context.Background(), inbox.JanitorConfig{})
		require.NoError(t, err)
		require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE response_body IS NOT NULL`))
		requireProblem(t, post(h, "k-1", `{"item":"book"}`), http.StatusUnprocessableEntity, httpbridge.ProblemResponseExpired)
		require.EqualValues(t, 1, a.runs.Load())
	})
}

// TestStaleResponseHook: the route's hook answers a retry whose stored
// response is gone with the resource's current state; a hook without an
// answer leaves the 422.
func TestStaleResponseHook(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	a := &app{}
	var got httpbridge.StaleInfo
	hook := func(w http.ResponseWriter, r *http.Request, info httpbridge.StaleInfo) bool {
		got = info
		if info.Key == "unknown" {
			return false
		}
		var id int64
		var body string
		if err := b.pg.Pool.QueryRow(r.Context(), `SELECT id, body FROM orders ORDER BY id LIMIT 1`).Scan(&id, &body); err != nil {
			return false
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		fmt.Fprintf(w, `{"id":%d,"body":%q,"current":true}`, id, body)
		return true
	}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", ResultTTL: 300 * time.Millisecond, StaleResponse: hook})(a)
	require.Equal(t, http.StatusCreated, post(h, "k-1", `{"item":"book"}`).Code)
	require.Equal(t, http.StatusCreated, post(h, "unknown", `{"item":"pen"}`).Code)

	var late response
	testsvc.Eventually(t, 10*time.Second, func() bool {
		late = post(h, "k-1", `{"item":"book"}`)
		return late.Code != http.StatusCreated
	}, "the stored response expires")
	require.Equal(t, http.StatusOK, late.Code, "body: %s", late.Body)
	require.True(t, late.replayed())
	require.NotEmpty(t, late.Header.Get("Idempotency-Key-Expires"))
	require.JSONEq(t, `{"id":1,"body":"{\"item\":\"book\"}","current":true}`, string(late.Body))
	require.Equal(t, "k-1", got.Key)
	require.False(t, got.CompletedAt.IsZero())
	require.True(t, got.KeyExpiresAt.After(time.Now()))

	testsvc.Eventually(t, 10*time.Second, func() bool {
		return post(h, "unknown", `{"item":"pen"}`).Code != http.StatusCreated
	}, "the second stored response expires")
	requireProblem(t, post(h, "unknown", `{"item":"pen"}`), http.StatusUnprocessableEntity, httpbridge.ProblemResponseExpired)
	require.EqualValues(t, 2, a.runs.Load())
}
