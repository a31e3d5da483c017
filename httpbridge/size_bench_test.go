package httpbridge_test

import (
	"encoding/base64"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

// sizedApp is the benchmark's handler: it inserts the order in the
// bridge's transaction (or, with bare, in one of its own) and answers 201
// with body, whose size is what BenchmarkResponseSize varies.
type sizedApp struct {
	pg   *testsvc.PG
	body []byte
	bare bool
}

func (a *sizedApp) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	req, _ := io.ReadAll(r.Body)
	tx := httpbridge.Tx(ctx)
	if a.bare {
		own, err := a.pg.Pool.Begin(ctx)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer own.Rollback(ctx) //nolint:errcheck
		tx = own
	}
	if _, err := tx.Exec(ctx, `INSERT INTO orders (body) VALUES ($1)`, string(req)); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	if a.bare {
		if err := tx.Commit(ctx); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
	}
	w.Header().Set("Content-Type", "text/plain")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(a.body)
}

// randomBody is n bytes of base64 text from random bytes: Postgres's
// compression of the stored response gains little on it, as on most
// real payloads that are not repetitive.
func randomBody(n int) []byte {
	raw := make([]byte, n)
	for i := range raw {
		raw[i] = byte(rand.Uint32())
	}
	return []byte(base64.StdEncoding.EncodeToString(raw)[:n])
}

// BenchmarkResponseSize: how the size of the response the bridge stores
// moves its cost. Sub-benchmarks size=100B, size=10KiB and size=1MiB run,
// interleaved in rounds (rotating which goes first) on 4 workers, five
// variants: a first request with a response of that size (claim, the
// handler's INSERT, the response stored with the commit), its replay
// (the same key again: the stored response read back and written out),
// the same handler without the bridge (its INSERT in a transaction of its
// own, the response written out: bare), and the first request and the
// replay at 100 B (the baseline; size=100B runs its three variants only).
// 20 rounds of 200 requests per variant (40 at 1 MiB; 2 rounds of 4
// under JUSTONCE_BENCH_SMALL=1), whatever b.N.
//
// Metrics: req/s and p99 of each variant; first/bare (the median over
// rounds of the first request's throughput over bare's), first-vs-100B
// and replay-vs-100B (the same against the 100 B variants).
func BenchmarkResponseSize(b *testing.B) {
	for _, size := range []struct {
		name string
		n    int
	}{{"100B", 100}, {"10KiB", 10 << 10}, {"1MiB", 1 << 20}} {
		b.Run("size="+size.name, func(b *testing.B) {
			responseSize(b, size.n)
		})
	}
}

func responseSize(b *testing.B, size int) {
	const workers = 4
	pg := testsvc.Postgres(b, testsvc.MaxConns(workers))
	pg.Exec(b, `CREATE TABLE orders (id bigserial PRIMARY KEY, body text NOT NULL)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	br, err := httpbridge.New(httpbridge.Config{Ledger: l})
	require.NoError(b, err)
	route := func(n int) http.Handler {
		return br.Route(httpbridge.RouteConfig{Scope: fmt.Sprint("orders-", n), MaxResponseBytes: 2 << 20})(
			&sizedApp{pg: pg, body: randomBody(n)})
	}
	bridged, small := route(size), route(100)
	bare := &sizedApp{pg: pg, body: randomBody(size), bare: true}
	names := []string{"bare", "first", "replay", "first-100B", "replay-100B"}
	variants := []func(i int) error{
		func(int) error { return expect(http.StatusCreated, bare, "") },
		func(i int) error { return expect(http.StatusCreated, bridged, fmt.Sprint("k-", i)) },
		func(int) error { return expect(http.StatusCreated, bridged, "replayed") },
		func(i int) error { return expect(http.StatusCreated, small, fmt.Sprint("k-", i)) },
		func(int) error { return expect(http.StatusCreated, small, "replayed") },
	}
	if size == 100 {
		names, variants = names[:3], variants[:3]
	}
	// Warm every variant's connections and statement caches, and store
	// the responses the replays answer with.
	for i := 0; i < 2*workers; i++ {
		for k, v := range variants {
			require.NoError(b, v(-1-i), names[k])
		}
	}
	// Rounds long enough to read a ratio from (tens of milliseconds at
	// least): 200 requests per variant, 40 where each stores 1 MiB.
	rounds, perRound := sized(20, 2), sized(200, 4)
	if size >= 1<<20 {
		perRound = sized(40, 4)
	}
	var took [][]time.Duration // per variant, per round
	var lat [][]time.Duration  // per variant, per request
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		took, lat = make([][]time.Duration, len(variants)), make([][]time.Duration, len(variants))
		seq := 0
		for r := 0; r < rounds; r++ {
			for k := range variants {
				v := (r + k) % len(variants)
				d, ls := measure(b, workers, perRound, seq, variants[v])
				seq += perRound
				took[v] = append(took[v], d)
				lat[v] = append(lat[v], ls...)
			}
		}
	}
	b.StopTimer()
	// ratio is the median over rounds of variant a's throughput over b's.
	ratio := func(a, c int) float64 {
		xs := make([]float64, rounds)
		for r := range xs {
			xs[r] = float64(took[c][r]) / float64(took[a][r])
		}
		return median(xs)
	}
	sum := func(ds []time.Duration) (t time.Duration) {
		for _, d := range ds {
			t += d
		}
		return t
	}
	for k, name := range names {
		slices.Sort(lat[k])
		b.ReportMetric(float64(rounds*perRound)/sum(took[k]).Seconds(), name+"-req/s")
		b.ReportMetric(float64(lat[k][(len(lat[k])-1)*99/100].Microseconds()), name+"-p99-µs")
	}
	b.ReportMetric(ratio(1, 0), "first/bare")
	if size != 100 {
		b.ReportMetric(ratio(1, 3), "first-vs-100B")
		b.ReportMetric(ratio(2, 4), "replay-vs-100B")
	}
	b.ReportMetric(float64(sum(took[1]).Nanoseconds())/float64(rounds*perRound), "ns/op")
}
