package httpbridge_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

// bundle is what a test needs: its own schema, a ledger on it (with or
// without Redis), a bridge, and a business table.
type bundle struct {
	pg     *testsvc.PG
	ledger *inbox.Ledger
	bridge *httpbridge.Bridge
	redis  redis.UniversalClient // nil without Redis
}

type setupOpts struct {
	redis    bool
	redisCfg *inbox.RedisConfig // a Redis of the test's own
	cfg      httpbridge.Config
	logger   *slog.Logger // the ledger's, which the bridge logs through
	pg       []testsvc.PGOption
}

func setup(t testing.TB, o setupOpts) *bundle {
	t.Helper()
	pg := testsvc.Postgres(t, o.pg...)
	pg.Exec(t, `CREATE TABLE orders (id bigserial PRIMARY KEY, body text NOT NULL)`)
	b := &bundle{pg: pg}
	icfg := inbox.Config{Logger: o.logger}
	switch {
	case o.redisCfg != nil:
		icfg.Redis = o.redisCfg
		b.redis = o.redisCfg.Client
	case o.redis:
		c, prefix := testsvc.Redis(t)
		icfg.Redis = &inbox.RedisConfig{Client: c, Prefix: prefix}
		b.redis = c
	}
	l, err := inbox.New(pg.Pool, icfg)
	require.NoError(t, err)
	b.ledger = l
	cfg := o.cfg
	cfg.Ledger = l
	if cfg.Tenant == nil {
		cfg.Tenant = func(r *http.Request) string { return r.Header.Get("X-Tenant") }
	}
	b.bridge, err = httpbridge.New(cfg)
	require.NoError(t, err)
	return b
}

// stores runs f once on Postgres alone and once with the Redis fast path,
// as parallel subtests.
func stores(t *testing.T, f func(t *testing.T, redisOn bool)) {
	for _, on := range []bool{false, true} {
		name := "postgres"
		if on {
			name = "redis"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			f(t, on)
		})
	}
}

func (b *bundle) orders(t testing.TB) int {
	t.Helper()
	return b.pg.Count(t, `SELECT count(*) FROM orders`)
}

// app is a business handler: it inserts an order in the request's
// transaction and answers 201 with a cookie, a Location and a JSON body.
type app struct {
	runs atomic.Int64
}

func (a *app) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.runs.Add(1)
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	tx := httpbridge.Tx(r.Context())
	if tx == nil {
		http.Error(w, "no transaction", http.StatusInternalServerError)
		return
	}
	var id int64
	if err := tx.QueryRow(r.Context(), `INSERT INTO orders (body) VALUES ($1) RETURNING id`, string(body)).Scan(&id); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
	w.Header().Set("Set-Cookie", "session=secret")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"body":%q}`, id, body)
}

// response is a received response, from a recorder or a real server.
type response struct {
	Code   int
	Header http.Header
	Body   []byte
}

func (r response) replayed() bool { return r.Header.Get("Idempotent-Replayed") == "true" }

// serve calls h directly with a request built from method, path, body and
// header pairs.
func serve(h http.Handler, method, path, body string, hdr ...string) response {
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	if body == "" {
		req = httptest.NewRequest(method, path, nil)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return response{Code: rec.Code, Header: rec.Result().Header, Body: rec.Body.Bytes()}
}

// post sends a JSON POST with an Idempotency-Key.
func post(h http.Handler, key, body string, hdr ...string) response {
	return serve(h, http.MethodPost, "/orders", body,
		append([]string{"Idempotency-Key", key, "Content-Type", "application/json"}, hdr...)...)
}

// send makes a real HTTP request to srv.
func send(t testing.TB, c *http.Client, ctx context.Context, url, key, body string) (response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := c.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return response{Code: resp.StatusCode, Header: resp.Header, Body: b}, err
}

type problemBody struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
}

func requireProblem(t testing.TB, r response, status int, typ string) problemBody {
	t.Helper()
	require.Equal(t, status, r.Code, "body: %s", r.Body)
	require.Equal(t, "application/problem+json", r.Header.Get("Content-Type"))
	var p problemBody
	require.NoError(t, json.Unmarshal(r.Body, &p), "body: %s", r.Body)
	require.Equal(t, typ, p.Type)
	require.Equal(t, status, p.Status)
	require.NotEmpty(t, p.Title)
	return p
}

// sameResponse compares two responses the way a client sees them: status,
// body, and every header but Date and the replay markers.
func sameResponse(t testing.TB, want, got response) {
	t.Helper()
	require.Equal(t, want.Code, got.Code)
	require.Equal(t, string(want.Body), string(got.Body))
	strip := func(h http.Header) http.Header {
		h = h.Clone()
		for _, k := range []string{"Date", "Idempotent-Replayed", "X-Idempotency-Replay", "Set-Cookie"} {
			h.Del(k)
		}
		return h
	}
	require.Equal(t, strip(want.Header), strip(got.Header))
}

// quietLog silences a test server's error log (expected panics).
func quietLog() *log.Logger { return log.New(io.Discard, "", 0) }

// deadLedger is a ledger on a Postgres that is not there.
func deadLedger(t testing.TB) *inbox.Ledger {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/postgres?sslmode=disable&connect_timeout=2")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	return l
}

// await waits for ch to close (or yield), failing the test after 10 s
// instead of hanging; errc, when given, reports an early end of the request
// that should have got there.
func await[T any](t testing.TB, ch <-chan T, what string, errc ...<-chan response) {
	t.Helper()
	var early <-chan response
	if len(errc) > 0 {
		early = errc[0]
	}
	select {
	case <-ch:
	case r := <-early:
		t.Fatalf("%s: the request ended first: %d %s", what, r.Code, r.Body)
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: not within 10s", what)
	}
}

// closer returns a func that closes ch once; it also runs when the test
// ends, before the pool is closed, so that a failed test never leaves a
// handler blocked (pool.Close would wait for its connection forever).
func closer(t testing.TB, ch chan struct{}) func() {
	var once sync.Once
	f := func() { once.Do(func() { close(ch) }) }
	t.Cleanup(f)
	return f
}
