package httpbridge_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

// byUser takes the principal from X-User ("" when absent).
func byUser(r *http.Request) string { return r.Header.Get("X-User") }

// TestPrincipalKeysAreIsolated: user B sends user A's key and body. B's
// request must run its own handler and never get A's stored response, and
// its answer must not depend on whether A used the key; A's retry still
// replays A's response.
func TestPrincipalKeysAreIsolated(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn, cfg: httpbridge.Config{Principal: byUser}})
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)

		alice := post(h, "shared-key", `{"item":"book"}`, "X-User", "alice")
		require.Equal(t, http.StatusCreated, alice.Code)

		bob := post(h, "shared-key", `{"item":"book"}`, "X-User", "bob")
		require.Equal(t, http.StatusCreated, bob.Code, "body: %s", bob.Body)
		require.False(t, bob.replayed(), "bob is not answered from alice's key")
		require.NotEqual(t, string(alice.Body), string(bob.Body), "bob never gets alice's body")
		require.EqualValues(t, 2, a.runs.Load(), "bob's request ran on its own")

		// Bob's answer looks the same as for a key nobody used.
		fresh := post(h, "never-used", `{"item":"book"}`, "X-User", "bob")
		require.Equal(t, bob.Code, fresh.Code)
		require.Equal(t, bob.replayed(), fresh.replayed())

		// Each retry replays its own principal's response.
		ar := post(h, "shared-key", `{"item":"book"}`, "X-User", "alice")
		require.True(t, ar.replayed())
		sameResponse(t, alice, ar)
		br := post(h, "shared-key", `{"item":"book"}`, "X-User", "bob")
		require.True(t, br.replayed())
		sameResponse(t, bob, br)
		// Another request under bob's key is bob's mismatch, not alice's.
		requireProblem(t, post(h, "shared-key", `{"item":"pen"}`, "X-User", "bob"),
			http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
		require.EqualValues(t, 3, a.runs.Load())

		// The ledger holds one row per principal, under the documented IDs,
		// with the principal recorded.
		for _, p := range []string{"alice", "bob"} {
			rec, err := b.ledger.Lookup(context.Background(),
				inbox.Key{Scope: "orders", ID: inbox.PrincipalKeyID("shared-key", p)})
			require.NoError(t, err)
			require.Equal(t, p, rec.Principal)
		}
		require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'shared-key'`))

		// A request without a principal keeps the plain key.
		anon := post(h, "anon-key", `{"item":"book"}`)
		require.Equal(t, http.StatusCreated, anon.Code)
		require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'anon-key'`))
	})
}

// TestPrincipalIsolatedWhileInFlight: while alice's request holds a key,
// bob's request with the same key is not told 409 (which would reveal that
// the key is in use): it runs at once.
func TestPrincipalIsolatedWhileInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{cfg: httpbridge.Config{Principal: byUser}})
	started, release := make(chan struct{}), make(chan struct{})
	unblock := closer(t, release)
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-User") == "alice" {
			close(started)
			<-release
		}
		a.ServeHTTP(w, r)
	}))
	done := make(chan response, 1)
	go func() { done <- post(h, "busy", `{}`, "X-User", "alice") }()
	await(t, started, "alice's handler started", done)

	// Control: the same principal does see the key in flight.
	requireProblem(t, post(h, "busy", `{}`, "X-User", "alice"), http.StatusConflict, httpbridge.ProblemInProgress)
	bob := post(h, "busy", `{}`, "X-User", "bob")
	require.Equal(t, http.StatusCreated, bob.Code, "body: %s", bob.Body)
	unblock()
	require.Equal(t, http.StatusCreated, (<-done).Code)
	require.EqualValues(t, 2, a.runs.Load())
}

// TestPrincipalShared: with PrincipalShared the key is the plain key, as
// before principal isolation: any principal of the tenant is answered from
// it, and it is shared with a consumer's event of the same ID.
func TestPrincipalShared(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{cfg: httpbridge.Config{Principal: byUser}})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", PrincipalKeys: inbox.PrincipalShared})(a)
	alice := post(h, "evt-1", `{}`, "X-User", "alice")
	require.Equal(t, http.StatusCreated, alice.Code)
	bob := post(h, "evt-1", `{}`, "X-User", "bob")
	require.True(t, bob.replayed())
	sameResponse(t, alice, bob)
	require.EqualValues(t, 1, a.runs.Load())

	// A consumer's event with the same ID is a duplicate of the request.
	out, err := b.ledger.Do(context.Background(), inbox.Request{Key: inbox.Key{Scope: "orders", ID: "evt-1"}, Source: inbox.Source("kafka")},
		func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil })
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)

	require.Error(t, httpbridge.RouteConfig{Scope: "s", PrincipalKeys: 9}.Validate())
}

// TestPrincipalKeyIDIsUnambiguous: no key a client can send equals a
// principal's ledger ID, and the ID has a fixed-length suffix that keeps
// route limits honest.
func TestPrincipalKeyIDIsUnambiguous(t *testing.T) {
	t.Parallel()
	id := inbox.PrincipalKeyID("k", "alice")
	require.True(t, utf8.ValidString(id))
	require.Len(t, id, 1+24)
	require.NotEqual(t, id, inbox.PrincipalKeyID("k", "bob"))
	require.Len(t, inbox.PrincipalKeyID("k", strings.Repeat("x", 1000)), 1+24)

	b := setup(t, setupOpts{cfg: httpbridge.Config{Principal: byUser}})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
	require.Equal(t, http.StatusCreated, post(h, "k", `{}`, "X-User", "alice").Code)
	// A caller without a principal cannot name alice's row: the ID is not
	// printable ASCII, so no key header can carry it.
	requireProblem(t, post(h, id, `{}`), http.StatusBadRequest, httpbridge.ProblemInvalidKey)

	// Key length: the digest takes 24 bytes of the ledger's 255.
	requireProblem(t, post(h, strings.Repeat("a", 232), `{}`, "X-User", "alice"), http.StatusBadRequest, httpbridge.ProblemInvalidKey)
	require.Equal(t, http.StatusCreated, post(h, strings.Repeat("a", 231), `{}`, "X-User", "alice").Code)
	nr := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders2", Mismatch: httpbridge.MismatchNewRequest})(a)
	requireProblem(t, post(nr, strings.Repeat("b", 215), `{}`, "X-User", "alice"), http.StatusBadRequest, httpbridge.ProblemInvalidKey)
	require.Equal(t, http.StatusCreated, post(nr, strings.Repeat("b", 214), `{}`, "X-User", "alice").Code)
}

// TestIsolatedKeyLimitWithoutPrincipal: a route that isolates principals
// takes keys of at most 231 bytes on every request, also one whose
// principal is "" (whose ID is the plain key): the limit is the route's,
// the same for every caller. A route with PrincipalShared takes 255.
func TestIsolatedKeyLimitWithoutPrincipal(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{cfg: httpbridge.Config{Principal: byUser}})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
	p := requireProblem(t, post(h, strings.Repeat("a", 232), `{}`), http.StatusBadRequest, httpbridge.ProblemInvalidKey)
	require.Contains(t, p.Detail, "231")
	require.Equal(t, http.StatusCreated, post(h, strings.Repeat("a", 231), `{}`).Code)
	_, err := b.ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: strings.Repeat("a", 231)})
	require.NoError(t, err, "without a principal the ID is the plain key")

	shared := b.bridge.Route(httpbridge.RouteConfig{Scope: "shared", PrincipalKeys: inbox.PrincipalShared})(a)
	require.Equal(t, http.StatusCreated, post(shared, strings.Repeat("s", 255), `{}`, "X-User", "alice").Code)
	requireProblem(t, post(shared, strings.Repeat("s", 256), `{}`, "X-User", "alice"), http.StatusBadRequest, httpbridge.ProblemInvalidKey)
}
