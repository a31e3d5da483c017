package inbox_test

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/migrations"
)

// benchLedger is a ledger on a fresh schema migrated with mc, with a
// payments table.
func benchLedger(b *testing.B, mc migrations.Config, cfg inbox.Config, conns int32) (*testsvc.PG, *inbox.Ledger) {
	pg := testsvc.Postgres(b, testsvc.MaxConns(conns), testsvc.NoMigrate())
	mc.Schema = pg.Schema
	_, err := migrations.New(pg.Pool, mc).Up(context.Background())
	require.NoError(b, err)
	pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
	l, err := inbox.New(pg.Pool, cfg)
	require.NoError(b, err)
	return pg, l
}

// bucketLoad inserts n rows into a time-bucket ledger, spread evenly over
// the buckets from fromAgo to toAgo before now, with expiry exp (SQL; b is
// the row's bucket).
func bucketLoad(b *testing.B, pg *testsvc.PG, n int, fromAgo, toAgo, width time.Duration, exp string) {
	iv := func(d time.Duration) string { return fmt.Sprintf("%d seconds", int(d.Seconds())) }
	if fromAgo == toAgo { // that one bucket only
		pg.Exec(b, `DO $$
DECLARE
    b    timestamptz := date_bin('`+iv(width)+`', now() - interval '`+iv(fromAgo)+`', 'epoch');
    name text := 'processed_events_p' || extract(epoch FROM b)::bigint;
BEGIN
    EXECUTE format('CREATE TABLE %I (LIKE processed_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', name);
    EXECUTE format('ALTER TABLE processed_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', name, b, b + interval '`+iv(width)+`');
END
$$`)
	} else {
		pg.Exec(b, `SELECT processed_events_create_buckets(now() - $1::interval)`, iv(fromAgo))
	}
	pg.Exec(b, `INSERT INTO processed_events (scope, tenant, event_id, status, source, created_at, completed_at, expires_at, bucket)
		SELECT 'bulk', '', 'evt-' || g, 'done', 'kafka', b, b, `+exp+`, b
		FROM generate_series(1, $1::int) g,
		LATERAL (SELECT date_bin($2::interval, now() - $3::interval, 'epoch') + (g % $4::int) * $2::interval AS b) x`,
		n, iv(width), iv(fromAgo), int((fromAgo-toAgo)/width)+1)
	pg.Exec(b, `VACUUM ANALYZE processed_events`)
	pg.Exec(b, `CHECKPOINT`)
}

// BenchmarkClaimBucketsVsPlain: Do with a one-insert handler on a plain
// ledger and on a time-bucket ledger (MaxTTL = JUSTONCE_BENCH_BUCKETS_PER_TTL
// buckets, default migrations.DefaultBucketsPerTTL (6): a claim checks 7
// buckets holding rows and JUSTONCE_BENCH_AHEAD empty ones ahead, default
// 2), each holding
// JUSTONCE_BENCH_ROWS live rows (default 1 million), alternating rounds in
// one run. Target: ratio ≥ 0.95.
func BenchmarkClaimBucketsVsPlain(b *testing.B) {
	rows := envInt("JUSTONCE_BENCH_ROWS", 1_000_000)
	for _, workers := range []int{1, 8} {
		b.Run(fmt.Sprintf("conns=%d", workers), func(b *testing.B) {
			plainPG, plain := benchLedger(b, migrations.Config{}, inbox.Config{}, int32(workers))
			bulkLoad(b, plainPG, rows, false)
			per := envInt("JUSTONCE_BENCH_BUCKETS_PER_TTL", migrations.DefaultBucketsPerTTL)
			const maxTTL = 40 * time.Minute
			width := maxTTL / time.Duration(per)
			bucketPG, buckets := benchLedger(b, migrations.Config{Layout: migrations.LayoutTimeBuckets,
				BucketWidth: width, MaxTTL: maxTTL, BucketsAhead: envInt("JUSTONCE_BENCH_AHEAD", 2)},
				inbox.Config{DefaultTTL: maxTTL}, int32(workers))
			bucketLoad(b, bucketPG, rows, maxTTL, 0, width, "b + interval '40 minutes'")
			b.ResetTimer()
			compare(b, workers, 4000, claimDo(plain, "p"), claimDo(buckets, "b"))
		})
	}
}

// BenchmarkClaimProbes: what a claim costs per bucket it looks the key up
// in. Do with a one-insert handler on a plain ledger (the baseline) and, on
// one time-bucket ledger loaded as in BenchmarkClaimBucketsVsPlain, five
// ways: as built (the look-up over the partitioned table: every bucket),
// every bucket's table named in the statement (UNION ALL), and only the
// current bucket's table plus the 0, 1 or 2 before it (rows in other
// buckets are not seen, so those three are measurements, not ledgers). All
// six alternate in one run; each reports its throughput ratio to the plain
// ledger.
func BenchmarkClaimProbes(b *testing.B) {
	rows := envInt("JUSTONCE_BENCH_ROWS", 1_000_000)
	for _, workers := range []int{1, 8} {
		b.Run(fmt.Sprintf("conns=%d", workers), func(b *testing.B) {
			ctx := context.Background()
			plainPG, plain := benchLedger(b, migrations.Config{}, inbox.Config{}, int32(workers))
			bulkLoad(b, plainPG, rows, false)
			const maxTTL = 40 * time.Minute
			width := maxTTL / migrations.DefaultBucketsPerTTL
			bucketPG, parent := benchLedger(b, migrations.Config{Layout: migrations.LayoutTimeBuckets,
				BucketWidth: width, MaxTTL: maxTTL}, inbox.Config{DefaultTTL: maxTTL}, int32(workers))
			bucketLoad(b, bucketPG, rows, maxTTL, 0, width, "b + interval '40 minutes'")
			// Every bucket, and the ones up to now's, newest first.
			var all, names []string
			require.NoError(b, bucketPG.Pool.QueryRow(ctx, `SELECT array_agg(c.relname::text ORDER BY c.relname DESC),
					array_agg(c.relname::text ORDER BY c.relname DESC)
						FILTER (WHERE substring(c.relname FROM '_p([0-9]+)$')::bigint <= extract(epoch FROM now()))
				FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
				WHERE i.inhparent = 'processed_events'::regclass`).Scan(&all, &names))
			require.GreaterOrEqual(b, len(names), 3)
			variants := []func(round, i int) error{claimDo(plain, "p"), claimDo(parent, "a")}
			for n := 0; n <= 3; n++ {
				probe := names[:n]
				if n == 0 {
					probe = all
				}
				l, err := inbox.New(bucketPG.Pool, inbox.Config{DefaultTTL: maxTTL})
				require.NoError(b, err)
				require.NoError(b, l.ProbeOnly(ctx, probe, names[0]))
				variants = append(variants, claimDo(l, fmt.Sprintf("n%d-", n)))
			}
			rounds, perRound := sized(40, 2), sized(100, 20)
			var took [][]time.Duration
			b.ResetTimer()
			for n := 0; n < b.N; n++ {
				took = interleave(b, workers, n*rounds, rounds, perRound, variants...)
			}
			b.StopTimer()
			b.ReportMetric(rate(took[0], perRound), "plain-ops/s")
			b.ReportMetric(speedRatio(took[1], took[0]), "as-built-ratio")
			b.ReportMetric(speedRatio(took[2], took[0]), "all-named-ratio")
			for n := 1; n <= 3; n++ {
				b.ReportMetric(speedRatio(took[n+2], took[0]), fmt.Sprintf("%d-probe-ratio", n))
			}
		})
	}
}

// claimDo is Do with a handler that inserts one payment, on keys tagged
// tag.
func claimDo(l *inbox.Ledger, tag string) func(round, i int) error {
	return func(round, i int) error {
		id := tag + strconv.Itoa(round) + "-" + strconv.Itoa(i)
		_, err := l.Do(context.Background(), inbox.Request{Key: inbox.Key{Scope: "claims", ID: id}},
			func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, id)
				return inbox.Result{}, err
			})
		return err
	}
}

// retentionRun is one layout's share of BenchmarkRetentionUnderLoad.
type retentionRun struct {
	quietRate, busyRate float64
	quiet, busy         []time.Duration
	purgeTook           atomic.Int64 // ns; 0 until the expired rows are gone
}

// BenchmarkRetentionUnderLoad: insert throughput and p99 of Do (4 workers)
// quiet (before and after), and while the janitor removes
// JUSTONCE_BENCH_EXPIRED expired rows
// (default 1 million) and keeps running: on the plain layout by batched deletes, on the
// time-bucket layout by dropping the bucket that holds them. Both in one
// run.
func BenchmarkRetentionUnderLoad(b *testing.B) {
	expired := envInt("JUSTONCE_BENCH_EXPIRED", 1_000_000)
	n := max(b.N, 5000)
	run := func(l *inbox.Ledger, purgeUntil func() bool) *retentionRun {
		r := &retentionRun{}
		r.quietRate, r.quiet = latencies(b, l, "quiet-", 4, n)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			t0 := time.Now()
			for ctx.Err() == nil {
				_, err := l.Purge(ctx, inbox.JanitorConfig{BatchSize: 1000, Pause: time.Millisecond})
				if err != nil && ctx.Err() == nil {
					b.Error(err)
					return
				}
				if r.purgeTook.Load() == 0 && purgeUntil() {
					r.purgeTook.Store(int64(time.Since(t0)))
				}
				time.Sleep(time.Millisecond) // the janitor keeps running through the measurement
			}
		}()
		r.busyRate, r.busy = latencies(b, l, "busy-", 4, n)
		for r.purgeTook.Load() == 0 && ctx.Err() == nil { // let the purge finish
			select {
			case <-done:
				cancel()
			case <-time.After(50 * time.Millisecond):
			}
		}
		cancel()
		<-done
		require.True(b, purgeUntil(), "the expired rows are gone")
		// Quiet again, after: quiet is both phases, so that a disturbance
		// in one (a checkpoint, another process) weighs on both sides less.
		rate, after := latencies(b, l, "after-", 4, n)
		r.quietRate = (r.quietRate + rate) / 2
		r.quiet = append(r.quiet, after...)
		sort.Slice(r.quiet, func(i, j int) bool { return r.quiet[i] < r.quiet[j] })
		return r
	}

	plainPG, plain := benchLedger(b, migrations.Config{}, inbox.Config{}, 9)
	bulkLoad(b, plainPG, expired, true)
	const width = 10 * time.Second
	bucketPG, buckets := benchLedger(b, migrations.Config{Layout: migrations.LayoutTimeBuckets,
		BucketWidth: width, MaxTTL: 4 * width}, inbox.Config{DefaultTTL: 4 * width}, 9)
	// All expired rows in one bucket, due to be dropped (the only old one:
	// claims check the same buckets before and after its drop).
	bucketLoad(b, bucketPG, expired, 60*time.Second, 60*time.Second, width, "now() - interval '5 seconds'")

	gone := func(pg *testsvc.PG) func() bool {
		return func() bool { return pg.Count(b, `SELECT count(*) FROM processed_events WHERE scope = 'bulk'`) == 0 }
	}
	b.ResetTimer()
	// Buckets first: the plain purge leaves autovacuum work behind, which
	// would run during the other layout's measurement.
	q := run(buckets, gone(bucketPG))
	p := run(plain, gone(plainPG))
	b.StopTimer()
	for _, x := range []struct {
		tag string
		r   *retentionRun
	}{{"plain", p}, {"buckets", q}} {
		b.ReportMetric(x.r.busyRate/x.r.quietRate, x.tag+"-throughput-ratio")
		b.ReportMetric(float64(pct(x.r.busy, 0.99))/float64(pct(x.r.quiet, 0.99)), x.tag+"-p99-ratio")
		b.ReportMetric(float64(pct(x.r.quiet, 0.99).Microseconds()), x.tag+"-quiet-p99-µs")
		b.ReportMetric(float64(pct(x.r.busy, 0.99).Microseconds()), x.tag+"-busy-p99-µs")
		b.ReportMetric(x.r.quietRate, x.tag+"-quiet-ops/s")
		b.ReportMetric(x.r.busyRate, x.tag+"-busy-ops/s")
		b.ReportMetric(float64(x.r.purgeTook.Load())/1e6, x.tag+"-purge-ms")
	}
}

// weekWidth is BenchmarkRetentionWeek's bucket width: the default (0)
// unless JUSTONCE_BENCH_BUCKETS_PER_TTL sets MaxTTL/width. (Likewise
// JUSTONCE_BENCH_AHEAD for the buckets ahead.)
func weekWidth(maxTTL time.Duration) time.Duration {
	if per := envInt("JUSTONCE_BENCH_BUCKETS_PER_TTL", 0); per > 0 {
		return maxTTL / time.Duration(per)
	}
	return 0
}

// BenchmarkRetentionWeek: a week of steady traffic in scaled time, on both
// layouts one after the other: a "day" is the TTL and MaxTTL
// (JUSTONCE_BENCH_DAY_S seconds, default 12), buckets have the default
// width (see weekWidth), traffic is
// JUSTONCE_BENCH_RATE Do calls a second (default 1500) on 4 workers, and
// the janitor runs every 250 ms. It reports table + index size over days
// 2–8 (swing around the mean, and the last day's mean against the second's),
// and the p99 of calls that started while a purge ran against those that
// did not.
func BenchmarkRetentionWeek(b *testing.B) {
	// 12 s: the default width (MaxTTL/6) is then whole seconds.
	day := time.Duration(envInt("JUSTONCE_BENCH_DAY_S", 12)) * time.Second
	rate := envInt("JUSTONCE_BENCH_RATE", 1500)
	for _, lay := range []struct {
		tag string
		mc  migrations.Config
	}{
		{"plain", migrations.Config{}},
		{"buckets", migrations.Config{Layout: migrations.LayoutTimeBuckets, MaxTTL: day, BucketWidth: weekWidth(day),
			BucketsAhead: envInt("JUSTONCE_BENCH_AHEAD", 0)}},
	} {
		pg, l := benchLedger(b, lay.mc, inbox.Config{DefaultTTL: day}, 6)
		ctx, cancel := context.WithCancel(context.Background())
		var purging atomic.Bool
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { // the janitor
			defer wg.Done()
			t := time.NewTicker(250 * time.Millisecond)
			defer t.Stop()
			for {
				purging.Store(true)
				_, err := l.Purge(ctx, inbox.JanitorConfig{})
				purging.Store(false)
				if err != nil && ctx.Err() == nil {
					b.Error(err)
				}
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		}()
		var mu sync.Mutex
		var duringPurge, quiet []time.Duration
		start := time.Now()
		end := start.Add(8 * day)
		var next atomic.Int64
		for w := 0; w < 4; w++ {
			wg.Add(1)
			go func() { // paced traffic: call i starts at start + i/rate
				defer wg.Done()
				for {
					i := next.Add(1) - 1
					at := start.Add(time.Duration(i) * time.Second / time.Duration(rate))
					if at.After(end) {
						return
					}
					time.Sleep(time.Until(at))
					busy := purging.Load()
					t0 := time.Now()
					_, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "week", ID: "e" + strconv.FormatInt(i, 10)}}, noop)
					d := time.Since(t0)
					if err != nil {
						b.Error(err)
						return
					}
					if time.Since(start) > day { // after the first day's fill
						mu.Lock()
						if busy || purging.Load() {
							duringPurge = append(duringPurge, d)
						} else {
							quiet = append(quiet, d)
						}
						mu.Unlock()
					}
				}
			}()
		}
		// Size, every quarter bucket, from the second day on.
		type sample struct {
			at    time.Duration
			bytes float64
		}
		var sizes []sample
		for time.Now().Before(end) {
			time.Sleep(day / 16)
			if since := time.Since(start); since > day {
				var sz int64
				require.NoError(b, pg.Pool.QueryRow(ctx,
					`SELECT coalesce((SELECT sum(pg_total_relation_size(relid))::bigint FROM pg_partition_tree('processed_events')),
						pg_total_relation_size('processed_events'))`).Scan(&sz))
				sizes = append(sizes, sample{since, float64(sz)})
			}
		}
		cancel()
		wg.Wait()
		minS, maxS, sum := sizes[0].bytes, sizes[0].bytes, 0.0
		var day2, day8 []float64
		for _, s := range sizes {
			minS, maxS, sum = min(minS, s.bytes), max(maxS, s.bytes), sum+s.bytes
			if s.at < 2*day {
				day2 = append(day2, s.bytes)
			}
			if s.at > 7*day {
				day8 = append(day8, s.bytes)
			}
		}
		mean := sum / float64(len(sizes))
		avg := func(xs []float64) float64 {
			t := 0.0
			for _, x := range xs {
				t += x
			}
			return t / float64(len(xs))
		}
		sort.Slice(quiet, func(i, j int) bool { return quiet[i] < quiet[j] })
		sort.Slice(duringPurge, func(i, j int) bool { return duringPurge[i] < duringPurge[j] })
		b.ReportMetric(mean/1e6, lay.tag+"-size-mean-MB")
		b.ReportMetric((maxS-minS)/2/mean*100, lay.tag+"-size-swing-±%")
		b.ReportMetric(avg(day8)/avg(day2), lay.tag+"-size-day8/day2")
		if len(quiet) > 0 && len(duringPurge) > 0 {
			b.ReportMetric(float64(pct(duringPurge, 0.99))/float64(pct(quiet, 0.99)), lay.tag+"-p99-purging/quiet")
			b.ReportMetric(float64(len(duringPurge))/float64(len(duringPurge)+len(quiet))*100, lay.tag+"-calls-during-purge-%")
		}
	}
}
