package httpbridge_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
)

// benchRequest is a keyed JSON POST, served in-process so that the numbers
// measure the bridge and its stores, not the loopback network or the test
// harness (one request value, reused; a writer that keeps only the status).
func benchRequest(h http.Handler, key string) int {
	r := benchReq
	r.Header = http.Header{"Content-Type": {"application/json"}}
	if key != "" {
		r.Header["Idempotency-Key"] = []string{key}
	}
	r.Body = io.NopCloser(strings.NewReader(benchBody))
	r.ContentLength = int64(len(benchBody))
	w := &statusWriter{h: http.Header{}}
	h.ServeHTTP(w, &r)
	return w.code
}

const benchBody = `{"item":"book","qty":1}`

var benchReq = *httptest.NewRequest(http.MethodPost, "/orders", nil)

type statusWriter struct {
	h    http.Header
	code int
}

func (w *statusWriter) Header() http.Header { return w.h }
func (w *statusWriter) WriteHeader(c int) {
	if w.code == 0 {
		w.code = c
	}
}
func (w *statusWriter) Write(b []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return len(b), nil
}

// compare runs base and subject alternately in rounds of perRound
// operations on workers goroutines, in one process, and reports both
// throughputs and their ratio (subject/base), as the inbox benchmarks do.
// Each benchmark sizes its own rounds: -benchtime 1x still measures.
func compare(b *testing.B, workers, perRound int, base, subject func(i int) error) {
	b.Helper()
	rounds := max(b.N/perRound, 3)
	var baseRate, subjRate float64
	seq := 0
	measure := func(f func(i int) error) float64 {
		var next atomic.Int64
		var failed atomic.Pointer[error]
		var wg sync.WaitGroup
		first := seq
		seq += perRound
		start := time.Now()
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= perRound || failed.Load() != nil {
						return
					}
					if err := f(first + i); err != nil {
						failed.CompareAndSwap(nil, &err)
						return
					}
				}
			}()
		}
		wg.Wait()
		if e := failed.Load(); e != nil {
			b.Fatal(*e)
		}
		return float64(perRound) / time.Since(start).Seconds()
	}
	b.ResetTimer()
	for r := 0; r < rounds; r++ {
		baseRate += measure(base)
		subjRate += measure(subject)
	}
	b.StopTimer()
	baseRate /= float64(rounds)
	subjRate /= float64(rounds)
	b.ReportMetric(baseRate, "base-ops/s")
	b.ReportMetric(subjRate, "ops/s")
	b.ReportMetric(subjRate/baseRate, "ratio")
	b.ReportMetric(1e9/subjRate, "ns/op")
}

func expect(code int, h http.Handler, key string) error {
	if c := benchRequest(h, key); c != code {
		return fmt.Errorf("status %d, want %d", c, code)
	}
	return nil
}

// BenchmarkReplay: a replay through the middleware answered from the
// Redis replay cache (subject) against one answered by Postgres alone
// (base): same route, same stored response. Target: ratio >= 3.
func BenchmarkReplay(b *testing.B) {
	for _, workers := range []int{1, 8} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			pg := testsvc.Postgres(b, testsvc.MaxConns(int32(workers)))
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
			require.NoError(b, expect(http.StatusCreated, hr, "r"))
			require.NoError(b, expect(http.StatusCreated, hp, "p"))
			hits := withRedis.Counters().CacheHits
			compare(b, workers, 2000,
				func(int) error { return expect(http.StatusCreated, hp, "p") },
				func(int) error { return expect(http.StatusCreated, hr, "r") })
			require.Greater(b, withRedis.Counters().CacheHits-hits, uint64(0), "replays came from Redis")
		})
	}
}

// BenchmarkFirstRequest: a first request through the middleware (claim,
// the handler's INSERT, stored response, commit: subject) against the same
// handler in a transaction of its own without the middleware (base).
// Target: ratio >= 0.9.
func BenchmarkFirstRequest(b *testing.B) {
	for _, workers := range []int{1, 8} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			pg := testsvc.Postgres(b, testsvc.MaxConns(int32(workers)))
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
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"id":%d,"body":%q}`, id, body)
			})
			for i := 0; i < 20; i++ { // warm both paths' connections and statement caches
				require.NoError(b, expect(http.StatusCreated, bridged, fmt.Sprint("warm-", i)))
				require.NoError(b, expect(http.StatusCreated, bare, ""))
			}
			compare(b, workers, 1000,
				func(int) error { return expect(http.StatusCreated, bare, "") },
				func(i int) error { return expect(http.StatusCreated, bridged, fmt.Sprint("k-", i)) })
		})
	}
}
