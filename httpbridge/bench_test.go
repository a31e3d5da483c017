package httpbridge_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
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

// benchSmall is set by JUSTONCE_BENCH_SMALL=1: every benchmark does a few
// short rounds, so that CI runs them (numbers not meant to be read).
var benchSmall = os.Getenv("JUSTONCE_BENCH_SMALL") == "1"

// sized returns full, or small under JUSTONCE_BENCH_SMALL=1.
func sized(full, small int) int {
	if benchSmall {
		return small
	}
	return full
}

// measure runs perRound calls of f on workers goroutines, f(i) with i from
// first on, and returns how long they took together and each call's
// latency, sorted. The first error fails the benchmark.
func measure(b *testing.B, workers, perRound, first int, f func(i int) error) (time.Duration, []time.Duration) {
	b.Helper()
	var next atomic.Int64
	var failed atomic.Pointer[error]
	var wg sync.WaitGroup
	lat := make([]time.Duration, perRound)
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
				t0 := time.Now()
				if err := f(first + i); err != nil {
					failed.CompareAndSwap(nil, &err)
					return
				}
				lat[i] = time.Since(t0)
			}
		}()
	}
	wg.Wait()
	if e := failed.Load(); e != nil {
		b.Fatal(*e)
	}
	took := time.Since(start)
	slices.Sort(lat)
	return took, lat
}

// compare measures base and subject side by side, as the inbox
// benchmarks do: a fixed number of rounds (not b.N), each running
// perRound operations of both on workers goroutines, alternating which
// goes first, so that a machine whose load changes during the run slows
// both alike. f(i) gets a number unique within the benchmark. It reports
// both throughputs and the median over rounds of subject/base.
func compare(b *testing.B, workers, rounds, perRound int, base, subject func(i int) error) {
	b.Helper()
	seq := 0
	run := func(f func(i int) error) time.Duration {
		took, _ := measure(b, workers, perRound, seq, f)
		seq += perRound
		return took
	}
	var baseTook, subjTook time.Duration
	var ratios []float64
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		baseTook, subjTook, ratios = 0, 0, ratios[:0]
		for r := 0; r < rounds; r++ {
			var tb, ts time.Duration
			if r%2 == 0 {
				tb, ts = run(base), run(subject)
			} else {
				ts, tb = run(subject), run(base)
			}
			baseTook += tb
			subjTook += ts
			ratios = append(ratios, float64(tb)/float64(ts))
		}
	}
	b.StopTimer()
	ratio := median(ratios)
	baseRate := float64(rounds*perRound) / baseTook.Seconds()
	subjRate := float64(rounds*perRound) / subjTook.Seconds()
	b.ReportMetric(baseRate, "base-ops/s")
	b.ReportMetric(subjRate, "ops/s")
	b.ReportMetric(ratio, "ratio")
	b.ReportMetric(1e9/subjRate, "ns/op")
}

// median is the median of xs (which it sorts).
func median(xs []float64) float64 {
	sort.Float64s(xs)
	m := xs[len(xs)/2]
	if len(xs)%2 == 0 {
		m = (xs[len(xs)/2-1] + m) / 2
	}
	return m
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
			compare(b, workers, sized(40, 2), sized(50*workers, 10),
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
			compare(b, workers, sized(40, 2), sized(25*workers, 10),
				func(int) error { return expect(http.StatusCreated, bare, "") },
				func(i int) error { return expect(http.StatusCreated, bridged, fmt.Sprint("k-", i)) })
		})
	}
}
