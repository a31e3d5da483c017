package httpbridge_test

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

// rows counts the ledger rows of the test's schema.
func (b *bundle) rows(t testing.TB) int {
	t.Helper()
	return b.pg.Count(t, `SELECT count(*) FROM processed_events`)
}

// TestSwallowedSQLErrorIsNotStored: a handler that ignores a failed
// statement (a unique violation) and answers 201 left its transaction
// aborted; COMMIT rolls back. The client must get the handler's failure
// (500 not-committed), nothing may be stored, and a retry with the same key
// must run again.
func TestSwallowedSQLErrorIsNotStored(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		b.pg.Exec(t, `CREATE TABLE seats (seat text PRIMARY KEY)`)
		b.pg.Exec(t, `INSERT INTO seats VALUES ('1A')`)
		var runs atomic.Int64
		var swallow atomic.Bool
		swallow.Store(true)
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			tx := httpbridge.Tx(r.Context())
			_, _ = tx.Exec(r.Context(), `INSERT INTO orders (body) VALUES ('booked')`)
			seat := "1A" // taken
			if !swallow.Load() {
				seat = "1B"
			}
			// The everyday mistake: "ignore the unique violation and go on".
			_, _ = tx.Exec(r.Context(), `INSERT INTO seats VALUES ($1)`, seat)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"booked":true}`))
		}))

		r := post(h, "swallow", `{"seat":"1A"}`)
		p := requireProblem(t, r, http.StatusInternalServerError, httpbridge.ProblemNotCommitted)
		require.Contains(t, p.Detail, "rolled back")
		require.NotContains(t, p.Detail, "seats", "no SQL detail reaches the client")
		require.Empty(t, r.Header.Get("Retry-After"), "not an availability problem")
		require.Zero(t, b.rows(t), "nothing stored: the key is free")
		require.Zero(t, b.orders(t))

		// Same key again, still failing: it runs again (not a replay).
		r = post(h, "swallow", `{"seat":"1A"}`)
		requireProblem(t, r, http.StatusInternalServerError, httpbridge.ProblemNotCommitted)
		require.False(t, r.replayed())
		require.EqualValues(t, 2, runs.Load())

		// Fixed: the same key runs and is stored.
		swallow.Store(false)
		r = post(h, "swallow", `{"seat":"1A"}`)
		require.Equal(t, http.StatusCreated, r.Code, "body: %s", r.Body)
		require.False(t, r.replayed())
		require.EqualValues(t, 3, runs.Load())
		require.Equal(t, 1, b.orders(t))
		require.Equal(t, 1, b.rows(t))
		require.True(t, post(h, "swallow", `{"seat":"1A"}`).replayed())
		require.EqualValues(t, 3, runs.Load())
	})
}

// TestDeferredConstraintAtCommitIsNotStored: a deferred foreign key fails
// at COMMIT (SQLSTATE 23503 from COMMIT). It is the handler's failure, not
// an unavailable store: 500 not-committed, no row, and the retry runs.
func TestDeferredConstraintAtCommitIsNotStored(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		b.pg.Exec(t, `CREATE TABLE customers (id int PRIMARY KEY)`)
		b.pg.Exec(t, `CREATE TABLE invoices (id serial PRIMARY KEY,
			customer int NOT NULL REFERENCES customers (id) DEFERRABLE INITIALLY DEFERRED)`)
		var runs atomic.Int64
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "invoices"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			// Accepted now, checked at COMMIT.
			if _, err := httpbridge.Tx(r.Context()).Exec(r.Context(), `INSERT INTO invoices (customer) VALUES (7)`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
		}))

		r := post(h, "deferred", `{}`)
		p := requireProblem(t, r, http.StatusInternalServerError, httpbridge.ProblemNotCommitted)
		require.Contains(t, p.Detail, "constraint checked at commit")
		require.NotContains(t, p.Detail, "invoices", "no SQL detail reaches the client")
		require.Empty(t, r.Header.Get("Retry-After"))
		require.Zero(t, b.rows(t))
		require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM invoices`))

		b.pg.Exec(t, `INSERT INTO customers VALUES (7)`)
		r = post(h, "deferred", `{}`)
		require.Equal(t, http.StatusCreated, r.Code, "the key was released: the retry runs; body: %s", r.Body)
		require.False(t, r.replayed())
		require.EqualValues(t, 2, runs.Load())
		require.Equal(t, 1, b.rows(t))
		require.True(t, post(h, "deferred", `{}`).replayed())
	})
}

// TestKeylessDeferredConstraintIsNotCommitted: the plain transaction of a
// request without a key fails at COMMIT the same way, and is answered the
// same way.
func TestKeylessDeferredConstraintIsNotCommitted(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	b.pg.Exec(t, `CREATE TABLE customers (id int PRIMARY KEY)`)
	b.pg.Exec(t, `CREATE TABLE invoices (id serial PRIMARY KEY,
		customer int NOT NULL REFERENCES customers (id) DEFERRABLE INITIALLY DEFERRED)`)
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "invoices"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = httpbridge.Tx(r.Context()).Exec(r.Context(), `INSERT INTO invoices (customer) VALUES (7)`)
		w.WriteHeader(http.StatusCreated)
	}))
	r := serve(h, http.MethodPost, "/invoices", `{}`)
	requireProblem(t, r, http.StatusInternalServerError, httpbridge.ProblemNotCommitted)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM invoices`))
}

// TestCommitUnknownAnswers503: the connection is cut after the server
// committed and before the bridge heard of it. The outcome is unknown, so
// the client gets 503 with Retry-After, and its retry gets the replay of
// what did commit: the handler ran once.
func TestCommitUnknownAnswers503(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t)
	pg.Exec(t, `CREATE TABLE orders (id bigserial PRIMARY KEY, body text NOT NULL)`)
	proxy := testsvc.Proxy(t, pg.Host())
	l, err := inbox.New(pg.PoolVia(t, proxy.Addr(), 2), inbox.Config{})
	require.NoError(t, err)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: l})
	require.NoError(t, err)
	a := &app{}
	h := bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)

	// CommandComplete of COMMIT: 'C', length, "COMMIT\x00".
	fired := proxy.CutWhenServerSends([]byte("COMMIT\x00"))
	r := post(h, "unknown", `{"n":1}`)
	select {
	case <-fired:
	default:
		t.Fatalf("the fault did not fire: %d %s", r.Code, r.Body)
	}
	requireProblem(t, r, http.StatusServiceUnavailable, httpbridge.ProblemStoreUnavailable)
	require.Equal(t, "1", r.Header.Get("Retry-After"))

	r = post(h, "unknown", `{"n":1}`)
	require.Equal(t, http.StatusCreated, r.Code, "body: %s", r.Body)
	require.True(t, r.replayed(), "it did commit: the retry is a replay")
	require.EqualValues(t, 1, a.runs.Load())
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM orders`))
}

// signalHandler is a slog.Handler that reports records whose message
// contains match.
type signalHandler struct {
	match string
	seen  chan string
}

func (h *signalHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *signalHandler) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, h.match) {
		select {
		case h.seen <- r.Message:
		default:
		}
	}
	return nil
}
func (h *signalHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *signalHandler) WithGroup(string) slog.Handler      { return h }

// leaseBridge is a lease-mode route whose ledger reaches Postgres through
// a fault proxy.
func leaseBridge(t *testing.T, logger *slog.Logger, handler func(w http.ResponseWriter, r *http.Request)) (*testsvc.PG, *testsvc.FaultProxy, http.Handler) {
	return leaseBridgeCfg(t, logger, httpbridge.Config{}, handler)
}

// leaseBridgeCfg is leaseBridge with a bridge configuration; logger is the
// ledger's, which the bridge logs through.
func leaseBridgeCfg(t *testing.T, logger *slog.Logger, cfg httpbridge.Config, handler func(w http.ResponseWriter, r *http.Request)) (*testsvc.PG, *testsvc.FaultProxy, http.Handler) {
	t.Helper()
	pg := testsvc.Postgres(t)
	proxy := testsvc.Proxy(t, pg.Host())
	l, err := inbox.New(pg.PoolVia(t, proxy.Addr(), 4), inbox.Config{Logger: logger})
	require.NoError(t, err)
	cfg.Ledger = l
	bridge, err := httpbridge.New(cfg)
	require.NoError(t, err)
	return pg, proxy, bridge.Route(httpbridge.RouteConfig{Scope: "payments", Lease: true, LeaseDuration: 30 * time.Second})(
		http.HandlerFunc(handler))
}

// TestLeaseCompletionRetriesTransientFailure: the database goes away after
// a lease-mode handler's effect happened and before its result is
// recorded. The bridge must keep the lease and retry the completion, so
// the client gets the handler's response, the result is stored, and a
// retry is a replay: the effect ran once. (Answering 503 and leaving the
// lease to lapse would let the retry charge again.)
func TestLeaseCompletionRetriesTransientFailure(t *testing.T) {
	t.Parallel()
	sig := &signalHandler{match: "recording a lease-mode result failed", seen: make(chan string, 1)}
	var charges atomic.Int64
	var proxy *testsvc.FaultProxy
	var pg *testsvc.PG
	pg, proxy, h := leaseBridge(t, slog.New(sig), func(w http.ResponseWriter, r *http.Request) {
		charges.Add(1)
		// The effect is done; now the database becomes unreachable.
		proxy.Refuse(true)
		proxy.CutAll()
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"charged":true}`))
	})
	go func() {
		// Bring the database back once a completion attempt has failed.
		select {
		case <-sig.seen:
		case <-time.After(20 * time.Second):
		}
		proxy.Refuse(false)
	}()

	r := post(h, "charge", `{"amount":5}`)
	require.Equal(t, http.StatusCreated, r.Code, "body: %s", r.Body)
	require.Equal(t, `{"charged":true}`, string(r.Body))
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'done' AND response_code = 201`))

	again := post(h, "charge", `{"amount":5}`)
	require.True(t, again.replayed(), "code %d body %s", again.Code, again.Body)
	require.EqualValues(t, 1, charges.Load())
}

// TestLeaseCompletionAnswerLost: the completion committed but its answer
// was cut. The retried completion finds the lease no longer processing;
// the bridge must see that its own completion did commit, and answer the
// handler's response rather than lease-lost or 503.
func TestLeaseCompletionAnswerLost(t *testing.T) {
	t.Parallel()
	var charges atomic.Int64
	var proxy *testsvc.FaultProxy
	var fired <-chan struct{}
	pg, proxy, h := leaseBridge(t, nil, func(w http.ResponseWriter, r *http.Request) {
		charges.Add(1)
		// The next UPDATE answered is the completion (renewals come every
		// 10 s): the server applies it, the bridge never hears of it.
		fired = proxy.CutWhenServerSends([]byte("UPDATE 1\x00"))
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"charged":true}`))
	})
	r := post(h, "charge", `{"amount":5}`)
	select {
	case <-fired:
	default:
		t.Fatalf("the fault did not fire: %d %s", r.Code, r.Body)
	}
	require.Equal(t, http.StatusCreated, r.Code, "body: %s", r.Body)
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'done'`))
	require.True(t, post(h, "charge", `{"amount":5}`).replayed())
	require.EqualValues(t, 1, charges.Load())
}

// TestLeaseCompletionGivesUpHonestly: the database stays away after the
// effect happened. The bridge retries for HandlerTimeout, then answers 503
// saying that the operation ran and when a retry runs it again; it never
// answers the handler's success for a result that was not recorded.
func TestLeaseCompletionGivesUpHonestly(t *testing.T) {
	t.Parallel()
	sig := &signalHandler{match: "recording a lease-mode result failed", seen: make(chan string, 1)}
	var proxy *testsvc.FaultProxy
	pg, proxy, h := leaseBridgeCfg(t, slog.New(sig), httpbridge.Config{HandlerTimeout: time.Second},
		func(w http.ResponseWriter, r *http.Request) {
			proxy.Refuse(true)
			proxy.CutAll()
			w.WriteHeader(http.StatusCreated)
		})
	start := time.Now()
	r := post(h, "charge", `{"amount":5}`)
	p := requireProblem(t, r, http.StatusServiceUnavailable, httpbridge.ProblemStoreUnavailable)
	require.Contains(t, p.Detail, "the operation ran")
	require.Equal(t, "1", r.Header.Get("Retry-After"))
	require.GreaterOrEqual(t, time.Since(start), time.Second, "it retried for HandlerTimeout")
	select {
	case <-sig.seen:
	default:
		t.Fatal("no completion attempt failed")
	}
	proxy.Refuse(false)
	// The lease is still held: the key is neither done nor free.
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'processing'`))
	requireProblem(t, post(h, "charge", `{"amount":5}`), http.StatusConflict, httpbridge.ProblemInProgress)
}
