package inbox_test

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// latencies runs n Do calls with a one-insert handler on workers
// goroutines and returns their rate and sorted latencies.
func latencies(b *testing.B, l *inbox.Ledger, prefix string, workers, n int) (float64, []time.Duration) {
	return latenciesUntil(b, l, prefix, workers, n, nil)
}

// latenciesUntil is latencies that goes on past n calls until done (polled
// every 20 ms) reports true; nil done stops at n.
func latenciesUntil(b *testing.B, l *inbox.Ledger, prefix string, workers, n int, done func() bool) (float64, []time.Duration) {
	ctx := context.Background()
	var next atomic.Int64
	var finished atomic.Bool
	if done == nil {
		finished.Store(true)
	} else {
		stop := make(chan struct{})
		defer close(stop)
		go func() {
			t := time.NewTicker(20 * time.Millisecond)
			defer t.Stop()
			for !done() {
				select {
				case <-stop:
					return
				case <-t.C:
				}
			}
			finished.Store(true)
		}()
	}
	var mu sync.Mutex
	lat := make([]time.Duration, 0, n)
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n && finished.Load() {
					return
				}
				id := prefix + strconv.Itoa(i)
				t0 := time.Now()
				_, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "scale", ID: id}}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
					_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, id)
					return inbox.Result{}, err
				})
				d := time.Since(t0)
				mu.Lock()
				lat = append(lat, d)
				mu.Unlock()
				if err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	rate := float64(len(lat)) / time.Since(start).Seconds()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return rate, lat
}

func pct(lat []time.Duration, p float64) time.Duration { return lat[int(float64(len(lat)-1)*p)] }

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// bulkLoad inserts n ledger rows with generate_series, expired or not.
func bulkLoad(b *testing.B, pg *testsvc.PG, n int, expired bool) {
	exp := "now() + interval '1 day'"
	if expired {
		exp = "now() - interval '1 minute'"
	}
	const chunk = 1_000_000
	for from := 0; from < n; from += chunk {
		to := min(from+chunk, n)
		pg.Exec(b, `INSERT INTO processed_events (scope, tenant, event_id, status, source, created_at, completed_at, expires_at)
			SELECT 'bulk', '', 'evt-' || g, 'done', 'kafka', now(), now(), `+exp+` FROM generate_series($1::int, $2::int - 1) g`, from, to)
	}
	pg.Exec(b, `VACUUM ANALYZE processed_events`)
	// Flush the load now so that its checkpoint is not measured.
	pg.Exec(b, `CHECKPOINT`)
}

// BenchmarkLedgerAtScale: per-event Do throughput and latency (8 workers,
// a one-insert handler) on a ledger that already holds many rows, against
// an empty ledger in the same run: two schemas, interleaved in rounds
// (rotating which goes first), so that outside load slows both alike.
// Sub-benchmarks by the rows loaded: rows=1M by default, and rows=10M as
// well with JUSTONCE_BENCH_SCALE=1 (rows=20k under JUSTONCE_BENCH_SMALL=1).
// The rows are loaded with generate_series, not through Do. 10 rounds of
// 500 calls each side (2 of 50 small), whatever b.N.
//
// Metrics: ratio (the median over rounds of full/empty throughput; insert
// cost must stay flat: close to 1), ops/s and p50/p99 of each side, the
// pages one key's look-up reads in each (lookup-pages), and the full
// ledger's table and index sizes.
func BenchmarkLedgerAtScale(b *testing.B) {
	sizes := []int{sized(1_000_000, 20_000)}
	if os.Getenv("JUSTONCE_BENCH_SCALE") == "1" && !benchSmall {
		sizes = append(sizes, 10_000_000)
	}
	for _, rows := range sizes {
		b.Run("rows="+countName(rows), func(b *testing.B) {
			ledgerAtScale(b, rows)
		})
	}
}

// lookupPages is how many pages the look-up of one ledger row reads, by
// EXPLAIN (ANALYZE, BUFFERS): the primary key's levels, root to leaf, and
// the row's heap page.
func lookupPages(b *testing.B, pg *testsvc.PG, scope, id string) int {
	var plan []struct {
		Plan struct {
			Hit  int `json:"Shared Hit Blocks"`
			Read int `json:"Shared Read Blocks"`
			Rows int `json:"Actual Rows"`
		}
	}
	require.NoError(b, pg.Pool.QueryRow(context.Background(), `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
		SELECT status FROM processed_events WHERE scope = $1 AND tenant = '' AND event_id = $2`, scope, id).Scan(&plan))
	require.Len(b, plan, 1)
	require.Equal(b, 1, plan[0].Plan.Rows, "the row looked up exists")
	return plan[0].Plan.Hit + plan[0].Plan.Read
}

// countName writes n as 20k, 1M, 10M.
func countName(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return strconv.Itoa(n/1_000_000) + "M"
	case n >= 1_000 && n%1_000 == 0:
		return strconv.Itoa(n/1_000) + "k"
	}
	return strconv.Itoa(n)
}

func ledgerAtScale(b *testing.B, rows int) {
	ledger := func() (*testsvc.PG, *inbox.Ledger) {
		pg := testsvc.Postgres(b, testsvc.MaxConns(8))
		pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
		l, err := inbox.New(pg.Pool, inbox.Config{})
		require.NoError(b, err)
		return pg, l
	}
	emptyPG, empty := ledger()
	fullPG, full := ledger()
	b.StopTimer()
	bulkLoad(b, fullPG, rows, false)
	require.Equal(b, rows, fullPG.Count(b, `SELECT count(*) FROM processed_events`))
	b.StartTimer()
	rounds, perRound := sized(10, 2), sized(500, 50)
	ledgers := [2]*inbox.Ledger{empty, full}
	var took [2][]time.Duration // per round
	var lat [2][]time.Duration  // per call
	for n := 0; n < b.N; n++ {
		took, lat = [2][]time.Duration{}, [2][]time.Duration{}
		for r := 0; r < rounds; r++ {
			for k := range ledgers {
				v := (r + k) % len(ledgers)
				ops, ls := latencies(b, ledgers[v], fmt.Sprintf("%d-%d-", n, r), 8, perRound)
				took[v] = append(took[v], time.Duration(float64(perRound)/ops*1e9))
				lat[v] = append(lat[v], ls...)
			}
		}
	}
	emptyLat, fullLat := lat[0], lat[1]
	sort.Slice(emptyLat, func(i, j int) bool { return emptyLat[i] < emptyLat[j] })
	sort.Slice(fullLat, func(i, j int) bool { return fullLat[i] < fullLat[j] })
	b.ReportMetric(rate(took[0], perRound), "empty-ops/s")
	b.ReportMetric(rate(took[1], perRound), "full-ops/s")
	b.ReportMetric(speedRatio(took[1], took[0]), "ratio")
	b.ReportMetric(float64(pct(emptyLat, 0.5).Microseconds()), "empty-p50-µs")
	b.ReportMetric(float64(pct(emptyLat, 0.99).Microseconds()), "empty-p99-µs")
	b.ReportMetric(float64(pct(fullLat, 0.5).Microseconds()), "full-p50-µs")
	b.ReportMetric(float64(pct(fullLat, 0.99).Microseconds()), "full-p99-µs")
	b.ReportMetric(float64(pct(fullLat, 0.99))/float64(pct(emptyLat, 0.99)), "p99-ratio")
	b.ReportMetric(float64(rows), "rows")
	b.ReportMetric(float64(lookupPages(b, emptyPG, "scale", fmt.Sprintf("0-0-%d", perRound/2))), "empty-lookup-pages")
	b.ReportMetric(float64(lookupPages(b, fullPG, "bulk", fmt.Sprintf("evt-%d", rows/2))), "full-lookup-pages")
	b.ReportMetric(float64(fullPG.Count(b, `SELECT pg_table_size('processed_events')`))/(1<<20), "table-MiB")
	b.ReportMetric(float64(fullPG.Count(b, `SELECT pg_indexes_size('processed_events')`))/(1<<20), "indexes-MiB")
	b.ReportMetric(1e9/rate(took[1], perRound), "ns/op")
}

// BenchmarkJanitorUnderLoad: p99 latency of Do while the janitor deletes
// JUSTONCE_BENCH_EXPIRED expired rows (1 million with JUSTONCE_BENCH_SCALE=1
// through scripts/bench.sh; 200,000 by default), against the same load
// without a purge: 5,000 calls each (200 under JUSTONCE_BENCH_SMALL=1),
// whatever b.N.
func BenchmarkJanitorUnderLoad(b *testing.B) {
	expired := envInt("JUSTONCE_BENCH_EXPIRED", sized(200_000, 20_000))
	pg := testsvc.Postgres(b, testsvc.MaxConns(9))
	pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	bulkLoad(b, pg, expired, true)
	n := sized(5000, 200)
	b.ResetTimer()
	quietRate, quiet := latencies(b, l, "quiet-", 4, n)

	ctx, cancel := context.WithCancel(context.Background())
	var deleted atomic.Int64
	var purgeTook time.Duration
	done := make(chan struct{})
	go func() {
		defer close(done)
		t0 := time.Now()
		for ctx.Err() == nil {
			d, _ := l.Purge(ctx, inbox.JanitorConfig{BatchSize: 1000, Pause: time.Millisecond})
			deleted.Add(d)
			if deleted.Load() >= int64(expired) || d == 0 {
				break
			}
		}
		purgeTook = time.Since(t0)
	}()
	// Measure while the purge runs (at least n operations).
	busyRate, busy := latencies(b, l, "busy-", 4, n)
	<-done
	cancel()
	require.EqualValues(b, expired, deleted.Load())
	b.ReportMetric(quietRate, "quiet-ops/s")
	b.ReportMetric(busyRate, "during-purge-ops/s")
	b.ReportMetric(float64(pct(quiet, 0.99).Microseconds()), "quiet-p99-µs")
	b.ReportMetric(float64(pct(busy, 0.99).Microseconds()), "during-purge-p99-µs")
	b.ReportMetric(float64(pct(busy, 0.99))/float64(pct(quiet, 0.99)), "p99-ratio")
	b.ReportMetric(float64(expired)/purgeTook.Seconds(), "purged-rows/s")
}
