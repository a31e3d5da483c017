package httpbridge_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
)

// benchRequest is a keyed JSON POST, served in-process so that the numbers
// measure the bridge and its stores, not the loopback network.
func benchRequest(h http.Handler, key string) int {
	req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"item":"book","qty":1}`))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec.Code
}

// BenchmarkReplay compares, in one run, a replay answered from the Redis
// replay cache with one answered by Postgres alone (same middleware, same
// stored response). It reports each path's ns/op and the speed-up
// (target: at least 3x).
func BenchmarkReplay(b *testing.B) {
	pg := testsvc.Postgres(b)
	pg.Exec(b, `CREATE TABLE orders (id bigserial PRIMARY KEY, body text NOT NULL)`)
	rc, prefix := testsvc.Redis(b)
	withRedis, err := inbox.New(pg.Pool, inbox.Config{Redis: &inbox.RedisConfig{Client: rc, Prefix: prefix}})
	require.NoError(b, err)
	pgOnly, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	route := func(l *inbox.Ledger) http.Handler {
		br, err := httpbridge.New(httpbridge.Config{Ledger: l})
		require.NoError(b, err)
		return br.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
	}
	hr, hp := route(withRedis), route(pgOnly)
	require.Equal(b, http.StatusCreated, benchRequest(hr, "r"))
	require.Equal(b, http.StatusCreated, benchRequest(hp, "p"))
	require.Equal(b, http.StatusCreated, benchRequest(hr, "r")) // now cached

	var tRedis, tPG time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		benchRequest(hr, "r")
		t1 := time.Now()
		benchRequest(hp, "p")
		tPG += time.Since(t1)
		tRedis += t1.Sub(t0)
	}
	b.StopTimer()
	hits := withRedis.Counters().CacheHits
	require.GreaterOrEqual(b, hits, uint64(b.N), "replays came from Redis")
	b.ReportMetric(float64(tRedis.Nanoseconds())/float64(b.N), "redis-ns/replay")
	b.ReportMetric(float64(tPG.Nanoseconds())/float64(b.N), "pg-ns/replay")
	b.ReportMetric(float64(tPG)/float64(tRedis), "speedup-x")
}

// BenchmarkFirstRequest compares, in one run, a first request through the
// middleware (claim, handler's insert, stored response, commit) with the
// same handler in a transaction of its own and no middleware. It reports
// the middleware's throughput relative to the bare handler (target: at
// least 0.9).
func BenchmarkFirstRequest(b *testing.B) {
	pg := testsvc.Postgres(b)
	pg.Exec(b, `CREATE TABLE orders (id bigserial PRIMARY KEY, body text NOT NULL)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	br, err := httpbridge.New(httpbridge.Config{Ledger: l})
	require.NoError(b, err)

	bridged := br.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx, err := pg.Pool.Begin(ctx)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer tx.Rollback(ctx) //nolint:errcheck
		body, _ := io.ReadAll(r.Body)
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO orders (body) VALUES ($1) RETURNING id`, string(body)).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if err := tx.Commit(ctx); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.Header().Set("Set-Cookie", "session=secret")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"body":%q}`, id, body)
	})
	for i := 0; i < 20; i++ { // warm both paths' connections and statement caches
		benchRequest(bridged, fmt.Sprint("warm-", i))
		benchRequest(bare, "")
	}

	var tMW, tBare time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if c := benchRequest(bridged, fmt.Sprint("k-", i)); c != http.StatusCreated {
			b.Fatalf("middleware: %d", c)
		}
		t1 := time.Now()
		if c := benchRequest(bare, ""); c != http.StatusCreated {
			b.Fatalf("bare: %d", c)
		}
		tBare += time.Since(t1)
		tMW += t1.Sub(t0)
	}
	b.StopTimer()
	b.ReportMetric(float64(tMW.Nanoseconds())/float64(b.N), "middleware-ns/req")
	b.ReportMetric(float64(tBare.Nanoseconds())/float64(b.N), "bare-ns/req")
	b.ReportMetric(float64(tBare)/float64(tMW), "relative-throughput")
}
