package inbox_test

import (
	"context"
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

// BenchmarkLedgerAtScale: per-event Do throughput and latency on an empty
// ledger and on one holding JUSTONCE_BENCH_ROWS rows (10 million with
// JUSTONCE_BENCH_SCALE=1 through scripts/bench.sh; 1 million by default).
// Insert cost must stay flat: ratio close to 1. 5,000 calls each (200
// under JUSTONCE_BENCH_SMALL=1), whatever b.N.
func BenchmarkLedgerAtScale(b *testing.B) {
	rows := envInt("JUSTONCE_BENCH_ROWS", sized(1_000_000, 20_000))
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	n := sized(5000, 200)
	b.ResetTimer()
	emptyRate, emptyLat := latencies(b, l, "empty-", 8, n)
	b.StopTimer()
	bulkLoad(b, pg, rows, false)
	b.StartTimer()
	fullRate, fullLat := latencies(b, l, "full-", 8, n)
	b.ReportMetric(emptyRate, "empty-ops/s")
	b.ReportMetric(fullRate, "full-ops/s")
	b.ReportMetric(fullRate/emptyRate, "ratio")
	b.ReportMetric(float64(pct(emptyLat, 0.99).Microseconds()), "empty-p99-µs")
	b.ReportMetric(float64(pct(fullLat, 0.99).Microseconds()), "full-p99-µs")
	b.ReportMetric(float64(pct(fullLat, 0.5).Microseconds()), "full-p50-µs")
	b.ReportMetric(float64(rows), "rows")
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
