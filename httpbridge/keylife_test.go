package httpbridge_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/harness/promtest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/fingerprint"
	"github.com/justonce/justonce/metrics"
)

// from sends a request from a client address and user agent.
func from(h http.Handler, key, body string, hdr ...string) response {
	req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
	req.RemoteAddr = "203.0.113.7:5555"
	req.Header.Set("User-Agent", "checkout/1.2")
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return response{Code: rec.Code, Header: rec.Result().Header, Body: rec.Body.Bytes()}
}

// expires reads the answer's Idempotency-Key-Expires.
func expires(t testing.TB, r response) time.Time {
	t.Helper()
	v := r.Header.Get("Idempotency-Key-Expires")
	require.NotEmpty(t, v, "no expiry on a %d answer", r.Code)
	at, err := http.ParseTime(v)
	require.NoError(t, err)
	return at
}

// TestExpiresHeader: every answer about a recorded key says when the key
// expires, rounded down to the second from the row's expiry; answers about
// no key, or a key left free, do not.
func TestExpiresHeader(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		release := make(chan struct{})
		done := closer(t, release)
		started := make(chan struct{}, 1)
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", TTL: 2 * time.Hour})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-Block") != "" {
				started <- struct{}{}
				<-release
			}
			if r.Header.Get("X-Fail") != "" {
				http.Error(w, "down", http.StatusServiceUnavailable)
				return
			}
			a.ServeHTTP(w, r)
		}))
		first := post(h, "exp-1", `{"a":1}`)
		require.Equal(t, http.StatusCreated, first.Code)
		rec, err := b.ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: "exp-1"})
		require.NoError(t, err)
		want := rec.ExpiresAt.UTC().Truncate(time.Second)
		require.Equal(t, want, expires(t, first), "the row's expiry, rounded down")
		require.WithinDuration(t, time.Now().Add(2*time.Hour), want, time.Minute)

		replay := post(h, "exp-1", `{"a":1}`)
		require.True(t, replay.replayed())
		require.Equal(t, want, expires(t, replay))
		reused := post(h, "exp-1", `{"a":2}`)
		requireProblem(t, reused, http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
		require.Equal(t, want, expires(t, reused))

		// In flight: a lower bound, at most the TTL from now.
		errc := make(chan response, 1)
		go func() { errc <- post(h, "exp-2", `{}`, "X-Block", "1") }()
		await(t, started, "the first request runs", errc)
		busy := post(h, "exp-2", `{}`, "X-Block", "1")
		requireProblem(t, busy, http.StatusConflict, httpbridge.ProblemInProgress)
		require.False(t, expires(t, busy).After(time.Now().Add(2*time.Hour)))
		done()
		require.Equal(t, http.StatusCreated, (<-errc).Code)

		for name, r := range map[string]response{
			"not stored": post(h, "exp-3", `{}`, "X-Fail", "1"),
			"no key":     serve(h, http.MethodPost, "/orders", `{}`),
			"bad key":    post(h, "a,b", `{}`),
		} {
			require.Empty(t, r.Header.Get("Idempotency-Key-Expires"), name)
		}
	})
}

// TestRetryStopsAtKeyExpiry, end to end: a lease-mode route whose keys
// last 6 s holds a key while its handler runs longer than that. A client
// retrying the key through httpretry gets 409s, each saying when the key
// expires, and stops before that point with ErrOutcomeUnknown, instead of
// sending the key to a server that would run it anew (as a plain request
// after the expiry shows).
func TestRetryStopsAtKeyExpiry(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{cfg: httpbridge.Config{RetryAfter: time.Second}})
	var runs atomic.Int64
	release := make(chan struct{})
	done := closer(t, release)
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "charges", Lease: true, TTL: 6 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			<-release
		}
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()
	defer done() // before srv.Close, which waits for the handler

	first := make(chan response, 1)
	go func() {
		r, _ := send(t, srv.Client(), context.Background(), srv.URL, "charge-1", `{}`)
		first <- r
	}()
	testsvc.Eventually(t, 10*time.Second, func() bool { return runs.Load() == 1 }, "the first request runs")

	var attempts atomic.Int64
	counting := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		attempts.Add(1)
		return srv.Client().Transport.RoundTrip(r)
	})
	c := &http.Client{Transport: &httpretry.Transport{Base: counting, MaxAttempts: 100,
		Backoff: backoff.Backoff{Initial: 200 * time.Millisecond, Max: time.Second}}}
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "charge-1")
	start := time.Now()
	_, err := c.Do(req)
	require.ErrorIs(t, err, httpretry.ErrOutcomeUnknown)
	var ou *httpretry.OutcomeUnknownError
	require.ErrorAs(t, err, &ou)
	require.Equal(t, "charge-1", ou.Key)
	require.Equal(t, http.StatusConflict, ou.Response.StatusCode)
	require.Greater(t, attempts.Load(), int64(1), "retried while the key lasted")
	require.Less(t, time.Since(start), 7*time.Second)
	require.EqualValues(t, 1, runs.Load(), "the client never made the server run the key again")

	// What the client avoided: once the key has expired, the server runs
	// the same key anew.
	testsvc.Eventually(t, 10*time.Second, func() bool { return !time.Now().Before(ou.Expires.Add(time.Second)) }, "the key expires")
	again, err := send(t, srv.Client(), context.Background(), srv.URL, "charge-1", `{}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, again.Code)
	require.EqualValues(t, 2, runs.Load())
	done()
	<-first
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// TestKeyReusedNamesDifferences: a 422 says which JSON members, query
// parameters and headers differ, never their values, and so does the
// log.
func TestKeyReusedNamesDifferences(t *testing.T) {
	t.Parallel()
	var l testsvc.JSONLog
	b := setup(t, setupOpts{logger: l.Logger()})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", FingerprintHeaders: []string{"Api-Version"}})(&app{})
	require.Equal(t, http.StatusCreated, from(h, "d-1", `{"amount":"10.00","to":{"iban":"FR76-1111"}}`, "Api-Version", "1").Code)
	got := from(h, "d-1", `{"amount":"99.00","to":{"iban":"FR76-2222"}}`, "Api-Version", "2")
	requireProblem(t, got, http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
	var p struct {
		Detail      string   `json:"detail"`
		Differences []string `json:"differences"`
	}
	require.NoError(t, json.Unmarshal(got.Body, &p))
	require.Equal(t, []string{"body:/amount", "body:/to/iban", "header:Api-Version"}, p.Differences)
	require.Contains(t, p.Detail, "body:/amount, body:/to/iban, header:Api-Version")
	line := l.One(t, "key reused with another request")
	require.Equal(t, "INFO", line["level"])
	require.Equal(t, []any{"body:/amount", "body:/to/iban", "header:Api-Version"}, line["differences"])
	require.Equal(t, "203.0.113.7:5555", line["client"])
	require.Equal(t, "checkout/1.2", line["user_agent"])
	for _, v := range []string{"99.00", "FR76", "10.00"} {
		require.NotContains(t, string(got.Body), v)
		require.NotContains(t, l.String(), v)
	}
}

// TestPlainFingerprintsStillMatch: keys stored with plain fingerprints,
// as releases before detailed ones stored them (LegacyFingerprints), are
// replayed to the same request, and another request with such a key gets
// 422 without differences.
func TestPlainFingerprintsStillMatch(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		old := setup(t, setupOpts{redis: redisOn, cfg: httpbridge.Config{LegacyFingerprints: true}})
		a := &app{}
		rc := httpbridge.RouteConfig{Scope: "orders"}
		first := post(old.bridge.Route(rc)(a), "p-1", `{"a":1}`)
		require.Equal(t, http.StatusCreated, first.Code)
		var stored []byte
		require.NoError(t, old.pg.Pool.QueryRow(context.Background(),
			`SELECT fingerprint FROM processed_events WHERE event_id = 'p-1'`).Scan(&stored))
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"a":1}`))
		req.Header.Set("Content-Type", "application/json")
		require.Equal(t, fingerprint.Request(req, []byte(`{"a":1}`), nil), stored, "what the previous release stored")

		cur, err := httpbridge.New(httpbridge.Config{Ledger: old.ledger})
		require.NoError(t, err)
		h := cur.Route(rc)(a)
		replay := post(h, "p-1", `{"a":1}`)
		require.True(t, replay.replayed(), "%d %s", replay.Code, replay.Body)
		sameResponse(t, first, replay)
		reused := post(h, "p-1", `{"a":2}`)
		requireProblem(t, reused, http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
		require.NotContains(t, string(reused.Body), "differences")
		require.EqualValues(t, 1, a.runs.Load())
	})
}

// TestFingerprintRowBytes measures what detailed fingerprints add to a
// ledger row, for a small JSON order.
func TestFingerprintRowBytes(t *testing.T) {
	t.Parallel()
	sizes := map[bool]int{}
	for _, legacy := range []bool{true, false} {
		b := setup(t, setupOpts{cfg: httpbridge.Config{LegacyFingerprints: legacy}})
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
		body := `{"amount":"12.50","currency":"EUR","customer":"c-42","note":"book"}`
		require.Equal(t, http.StatusCreated, post(h, "size", body).Code)
		var fp, row int
		require.NoError(t, b.pg.Pool.QueryRow(context.Background(),
			`SELECT octet_length(fingerprint), pg_column_size(e.*) FROM processed_events e WHERE event_id = 'size'`).Scan(&fp, &row))
		t.Logf("legacy=%v: fingerprint %d bytes, row %d bytes", legacy, fp, row)
		sizes[legacy] = fp
	}
	require.Equal(t, 33, sizes[true])
	require.Greater(t, sizes[false], 33)
	require.LessOrEqual(t, sizes[false], 33+fingerprint.MaxSectionBytes)
}

// TestKeyValidatorAndMaxKeyLen: a route's own key rule refuses with its
// message (400 invalid-key), logged at WARN with the key masked; a route
// may take keys of at most 128 bytes.
func TestKeyValidatorAndMaxKeyLen(t *testing.T) {
	t.Parallel()
	var l testsvc.JSONLog
	b := setup(t, setupOpts{logger: l.Logger(), cfg: httpbridge.Config{MaxKeyLen: 200}})
	format := regexp.MustCompile(`^[a-z0-9_]+:[a-z.]+:[a-z0-9_]+:\d{13}$`)
	rc := httpbridge.RouteConfig{Scope: "bookings", MaxKeyLen: 128, KeyValidator: func(key string) error {
		if !format.MatchString(key) {
			return errors.New("the key must be {user}:{operation}:{resource}:{timestamp in ms}")
		}
		return nil
	}}
	h := b.bridge.Route(rc)(&app{})
	require.Equal(t, http.StatusCreated, from(h, "usr_abc123:booking.create:res_xyz:1704067200000", `{}`).Code)
	got := from(h, "usr_abc123-booking-create", `{}`)
	p := requireProblem(t, got, http.StatusBadRequest, httpbridge.ProblemInvalidKey)
	require.Equal(t, "the key must be {user}:{operation}:{resource}:{timestamp in ms}", p.Detail)
	line := l.One(t, "invalid key")
	require.Equal(t, "WARN", line["level"])
	require.Equal(t, "usr_****eate", line["key"])
	require.Equal(t, "203.0.113.7:5555", line["client"])
	require.Equal(t, "checkout/1.2", line["user_agent"])
	require.NotContains(t, l.String(), "usr_abc123-booking")

	long := "u:booking.create:" + strings.Repeat("r", 98) + ":1704067200000" // 129 bytes
	require.Len(t, long, 129)
	p = requireProblem(t, from(h, long, `{}`), http.StatusBadRequest, httpbridge.ProblemInvalidKey)
	require.Contains(t, p.Detail, "longer than 128")
	ok := "u:booking.create:" + strings.Repeat("r", 97) + ":1704067200000" // 128
	require.Equal(t, http.StatusCreated, from(h, ok, `{}`).Code)

	// The Config's limit holds where the route sets none.
	other := b.bridge.Route(httpbridge.RouteConfig{Scope: "other"})(&app{})
	requireProblem(t, from(other, strings.Repeat("k", 201), `{}`), http.StatusBadRequest, httpbridge.ProblemInvalidKey)
	require.Equal(t, http.StatusCreated, from(other, strings.Repeat("k", 200), `{}`).Code)
	require.Panics(t, func() { b.bridge.Route(httpbridge.RouteConfig{Scope: "x", MaxKeyLen: 256}) })
}

// TestLogLevels: a missing key on a route that requires one is logged at
// WARN, a replay at INFO, each with the client's address and user agent
// and the key masked.
func TestLogLevels(t *testing.T) {
	t.Parallel()
	var l testsvc.JSONLog
	b := setup(t, setupOpts{logger: l.Logger()})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})(&app{})
	requireProblem(t, from(h, "", `{}`), http.StatusBadRequest, httpbridge.ProblemMissingKey)
	line := l.One(t, "missing key")
	require.Equal(t, "WARN", line["level"])
	require.Equal(t, "203.0.113.7:5555", line["client"])
	require.Equal(t, "checkout/1.2", line["user_agent"])

	const key = "550e8400-e29b-41d4-a716-446655440000"
	require.Equal(t, http.StatusCreated, from(h, key, `{}`).Code)
	require.True(t, from(h, key, `{}`).replayed())
	line = l.One(t, "justonce/httpbridge: replay")
	require.Equal(t, "INFO", line["level"])
	require.Equal(t, "orders//550e****0000", line["key"])
	require.Equal(t, "203.0.113.7:5555", line["client"])
	require.Equal(t, "checkout/1.2", line["user_agent"])
	require.NotContains(t, l.String(), key)
}

// TestKeyRateLimit: 20 new keys of one tenant at once against a limit of 5
// per window: 5 run, 15 get 429 key-rate-exceeded with Retry-After and
// leave nothing behind; the 5 replay as usual. On Postgres alone every
// handler ran (none had committed when the others checked the count) and
// the count's CHECK refused the extra ones at commit: contention; with
// Redis the extra ones never ran.
func TestKeyRateLimit(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		var l testsvc.JSONLog
		b := setup(t, setupOpts{redis: redisOn, logger: l.Logger(), pg: []testsvc.PGOption{testsvc.MaxConns(24)}})
		const n, limit = 20, 5
		var entered, refused atomic.Int64
		a := &app{}
		rc := httpbridge.RouteConfig{Scope: "orders", KeyRate: &inbox.KeyRate{
			Limit: func(tenant string) int64 { return map[string]int64{"acme": limit}[tenant] }, Window: time.Hour}}
		h := b.bridge.Route(rc)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// Hold the first handlers until every request is either in
			// its handler or refused.
			if entered.Add(1) <= n {
				deadline := time.Now().Add(10 * time.Second)
				for entered.Load()+refused.Load() < n && time.Now().Before(deadline) {
					time.Sleep(5 * time.Millisecond)
				}
			}
			a.ServeHTTP(w, r)
		}))
		codes := make([]response, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				codes[i] = post(h, fmt.Sprintf("rate-%d", i), `{}`, "X-Tenant", "acme")
				if codes[i].Code == http.StatusTooManyRequests {
					refused.Add(1)
				}
			}()
		}
		wg.Wait()
		var ok []int
		for i, r := range codes {
			if r.Code == http.StatusCreated {
				ok = append(ok, i)
				continue
			}
			requireProblem(t, r, http.StatusTooManyRequests, httpbridge.ProblemKeyRateExceeded)
			require.NotEmpty(t, r.Header.Get("Retry-After"))
			require.Empty(t, r.Header.Get("Idempotency-Key-Expires"), "nothing recorded")
		}
		require.Len(t, ok, limit)
		require.Equal(t, limit, b.orders(t))
		require.Equal(t, limit, b.pg.Count(t, `SELECT count(*) FROM processed_events`), "a refused key leaves no row")
		if redisOn {
			require.EqualValues(t, limit, a.runs.Load(), "Redis refused before the handler")
		} else {
			require.EqualValues(t, n, a.runs.Load(), "every handler ran: the commit refused the extra ones")
		}
		// Replays are never limited; new keys are, until the window ends;
		// another tenant is not.
		for _, i := range ok {
			require.True(t, post(h, fmt.Sprintf("rate-%d", i), `{}`, "X-Tenant", "acme").replayed())
		}
		requireProblem(t, post(h, "rate-late", `{}`, "X-Tenant", "acme"), http.StatusTooManyRequests, httpbridge.ProblemKeyRateExceeded)
		require.Equal(t, http.StatusCreated, post(h, "rate-other", `{}`, "X-Tenant", "globex").Code)
		require.NotEmpty(t, l.Find("new-key rate limit reached"))
	})
}

// TestObserveMode: an observe-mode route blocks nothing: a request the
// bridge would refuse (no key on a required route, a malformed key), a
// duplicate, a mismatch and a key in flight all reach the handler as they
// came, without a transaction or a replay; the metric and the log say
// what enforcing would have done. Its keys are apart from an enforcing
// route's.
func TestObserveMode(t *testing.T) {
	t.Parallel()
	var l testsvc.JSONLog
	bc := metrics.NewBridgeCollector()
	b := setup(t, setupOpts{logger: l.Logger(), cfg: httpbridge.Config{OnObserve: bc.Observer("http")}})
	var runs atomic.Int64
	release := make(chan struct{})
	done := closer(t, release)
	started := make(chan struct{}, 1)
	var sawTx atomic.Bool
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if httpbridge.Tx(r.Context()) != nil {
			sawTx.Store(true)
		}
		if r.Header.Get("X-Block") != "" {
			started <- struct{}{}
			<-release
		}
		body, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "ran %d: %s", runs.Load(), body)
		http.NewResponseController(w).Flush()
	})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true, Observe: true})(handler)
	reg := prometheus.NewRegistry()
	reg.MustRegister(bc)
	count := func(would string) float64 {
		return promtest.CounterValue(t, reg, "justonce_bridge_observed_total", map[string]string{"front": "http", "route": "orders", "would": would})
	}

	// Would refuse: no key, then a malformed one; both run.
	got := from(h, "", `{"a":1}`)
	require.Equal(t, http.StatusCreated, got.Code)
	require.Equal(t, `ran 1: {"a":1}`, string(got.Body), "the handler reads the body")
	require.Equal(t, 1.0, count("would_refuse_missing_key"))
	line := l.One(t, "observe mode: missing key")
	require.Equal(t, "WARN", line["level"])
	require.Equal(t, "would_refuse_missing_key", line["would"])
	require.Equal(t, "203.0.113.7:5555", line["client"])
	require.Equal(t, "checkout/1.2", line["user_agent"])
	require.Equal(t, http.StatusCreated, from(h, "a,b", `{}`).Code)
	require.Equal(t, 1.0, count("would_refuse_invalid_key"))
	require.Equal(t, "WARN", l.One(t, "observe mode: invalid key")["level"])

	// A key, then its duplicate, then a mismatch: all run, none replayed.
	first := from(h, "obs-1", `{"a":1}`)
	require.Equal(t, http.StatusCreated, first.Code)
	require.Equal(t, 1.0, count("would_run"))
	dup := from(h, "obs-1", `{"a":1}`)
	require.Equal(t, http.StatusCreated, dup.Code)
	require.Equal(t, `ran 4: {"a":1}`, string(dup.Body), "the handler ran again")
	require.False(t, dup.replayed())
	require.Empty(t, dup.Header.Get("Idempotency-Key-Expires"), "no header of the bridge's")
	require.Equal(t, 1.0, count("would_replay"))
	line = l.One(t, "observe mode: duplicate")
	require.Equal(t, "INFO", line["level"])
	require.Equal(t, "orders~observe//*****", line["key"])
	require.Equal(t, http.StatusCreated, from(h, "obs-1", `{"a":2}`).Code)
	require.Equal(t, 1.0, count("would_mismatch"))
	require.Equal(t, []any{"body:/a"}, l.One(t, "observe mode: key reused")["differences"])

	// A key in flight: the duplicate runs beside it.
	errc := make(chan response, 1)
	go func() { errc <- from(h, "obs-2", `{}`, "X-Block", "1") }()
	await(t, started, "the first request runs", errc)
	require.Equal(t, http.StatusCreated, from(h, "obs-2", `{}`).Code)
	require.Equal(t, 1.0, count("would_conflict"))
	done()
	require.Equal(t, http.StatusCreated, (<-errc).Code)
	require.False(t, sawTx.Load(), "no transaction of the bridge's")
	require.EqualValues(t, 7, runs.Load(), "every request ran")

	// The observed keys are under their own scope: an enforcing route
	// runs obs-1 as new, and then replays it.
	require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'orders~observe'`))
	enforce := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})(&app{})
	require.Equal(t, http.StatusCreated, from(enforce, "obs-1", `{"a":1}`).Code)
	require.True(t, from(enforce, "obs-1", `{"a":1}`).replayed())
	requireProblem(t, from(enforce, "", `{}`), http.StatusBadRequest, httpbridge.ProblemMissingKey)
}
