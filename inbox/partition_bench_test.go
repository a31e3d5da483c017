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

// bucketLoad inserts n rows into a time-bucket ledger as it is in steady
// state, with expiry exp (SQL): every shard has moved on once (openNext),
// and half the rows sit in each shard's older bucket, half in its newest.
// With old, all of them sit in the older buckets (exp must then be in the
// past), and dueOldBuckets makes those due to go.
func bucketLoad(b *testing.B, pg *testsvc.PG, n int, exp string, old bool) {
	// JUSTONCE_BENCH_BUCKETS=1: each shard has its first bucket only (as
	// for half of each width when BucketWidth is 2 × MaxTTL), which holds
	// all the rows; a claim looks in one bucket.
	one := !old && envInt("JUSTONCE_BENCH_BUCKETS", 2) == 1
	if !one {
		pg.Exec(b, `SELECT processed_events_open_bucket(s, now()) FROM generate_series(0, (SELECT shards FROM processed_events_layout) - 1) s`)
		pg.Exec(b, `UPDATE processed_events_buckets o SET closed_at = now()
			WHERE closed_at IS NULL AND EXISTS (SELECT 1 FROM processed_events_buckets n WHERE n.shard = o.shard AND n.id > o.id)`)
	}
	pg.Exec(b, `INSERT INTO processed_events (scope, tenant, event_id, status, source, created_at, completed_at, expires_at, bucket)
		SELECT 'bulk', '', x.id, 'done', 'kafka', now(), now(), `+exp+`,
			processed_events_shard('bulk', '', x.id) + CASE WHEN $2 OR $3 OR g % 2 = 0 THEN 0 ELSE l.shards END
		FROM generate_series(1, $1::int) g, processed_events_layout l, LATERAL (SELECT 'evt-' || g AS id) x`, n, old, one)
	pg.Exec(b, `VACUUM ANALYZE processed_events`)
	pg.Exec(b, `CHECKPOINT`)
}

// dueOldBuckets makes the closed buckets of bucketLoad due to be dropped
// one shard at a time, a second apart from now (as the janitor finds them
// in steady state, where the shards' buckets turn over width/shards apart).
func dueOldBuckets(b *testing.B, pg *testsvc.PG) {
	pg.Exec(b, `UPDATE processed_events_buckets SET closed_at = now() - (SELECT max_ttl FROM processed_events_layout)
			+ shard * interval '1 second'
		WHERE closed_at IS NOT NULL`)
}

// BenchmarkClaimBucketsVsPlain: Do with a one-insert handler on a plain
// ledger and on a time-bucket ledger (default width and shards,
// JUSTONCE_BENCH_SHARDS overrides the shards) in steady state: each shard
// has two buckets, so a claim looks its key up in two
// (JUSTONCE_BENCH_BUCKETS=1: one, see bucketLoad). Each holds
// JUSTONCE_BENCH_ROWS live rows (default 1 million), alternating rounds in
// one run: JUSTONCE_BENCH_CLAIMS calls of each (default 16,000, in 40
// rounds; with fewer, a round of eight connections lasts tens of
// milliseconds and its slowest call weighs on it). New keys sort after the
// loaded ones; JUSTONCE_BENCH_KEYS=spread claims keys that land all over
// the loaded keys' index instead (claimSpread), as random event IDs do.
// Target: ratio ≥ 0.95.
func BenchmarkClaimBucketsVsPlain(b *testing.B) {
	rows := envInt("JUSTONCE_BENCH_ROWS", 1_000_000)
	for _, workers := range []int{1, 8} {
		b.Run(fmt.Sprintf("conns=%d", workers), func(b *testing.B) {
			plainPG, plain := benchLedger(b, migrations.Config{}, inbox.Config{}, int32(workers))
			bulkLoad(b, plainPG, rows, false)
			const maxTTL = 40 * time.Minute
			bucketPG, buckets := benchLedger(b, migrations.Config{Layout: migrations.LayoutTimeBuckets,
				MaxTTL: maxTTL, Shards: envInt("JUSTONCE_BENCH_SHARDS", 0)},
				inbox.Config{DefaultTTL: maxTTL}, int32(workers))
			bucketLoad(b, bucketPG, rows, "now() + interval '40 minutes'", false)
			b.ResetTimer()
			claims := envInt("JUSTONCE_BENCH_CLAIMS", sized(16_000, 4000))
			if os.Getenv("JUSTONCE_BENCH_KEYS") == "spread" {
				perRound := sized(max(claims/40, 1), 20) // as compare sizes its rounds
				compare(b, workers, claims, claimSpread(plain, rows, perRound), claimSpread(buckets, rows, perRound))
				return
			}
			compare(b, workers, claims, claimDo(plain, "p"), claimDo(buckets, "b"))
		})
	}
}

// BenchmarkDoEachBucketsVsPlain: DoEach (the batched consumers' claim) of
// 50 new keys with a one-insert handler (see batchesVsPlain).
func BenchmarkDoEachBucketsVsPlain(b *testing.B) {
	batchesVsPlain(b, 50, func(l *inbox.Ledger, reqs []inbox.Request) error {
		run, err := l.DoEach(context.Background(), reqs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, k int) (inbox.Result, error) {
			_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, reqs[k].ID)
			return inbox.Result{}, err
		})
		if err == nil && len(run.Outcomes) != len(reqs) {
			err = fmt.Errorf("%d outcomes", len(run.Outcomes))
		}
		return err
	})
}

// BenchmarkDoBatchBucketsVsPlain: DoBatch of 100 new keys with a handler
// that inserts their payments (see batchesVsPlain).
func BenchmarkDoBatchBucketsVsPlain(b *testing.B) {
	batchesVsPlain(b, 100, func(l *inbox.Ledger, reqs []inbox.Request) error {
		outs, err := l.DoBatch(context.Background(), reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
			bt := &pgx.Batch{}
			for _, k := range fresh {
				bt.Queue(`INSERT INTO payments VALUES ($1, 1)`, reqs[k].ID)
			}
			return nil, tx.SendBatch(ctx, bt).Close()
		})
		if err == nil && outs[len(reqs)-1].Disposition != inbox.Executed {
			err = fmt.Errorf("unexpected %v", outs[len(reqs)-1].Disposition)
		}
		return err
	})
}

// batchesVsPlain runs op on batches of size new keys, 4 workers, on a plain
// ledger and on a time-bucket ledger in steady state (two buckets per
// shard), each holding JUSTONCE_BENCH_ROWS live rows (default 1 million),
// alternating rounds in one run: 20 rounds of 40 batches each (a round of
// a few batches lasts tens of milliseconds, and its slowest batch weighs
// on it).
func batchesVsPlain(b *testing.B, size int, op func(l *inbox.Ledger, reqs []inbox.Request) error) {
	rows := envInt("JUSTONCE_BENCH_ROWS", 1_000_000)
	const workers = 4
	plainPG, plain := benchLedger(b, migrations.Config{}, inbox.Config{}, workers)
	bulkLoad(b, plainPG, rows, false)
	const maxTTL = 40 * time.Minute
	bucketPG, buckets := benchLedger(b, migrations.Config{Layout: migrations.LayoutTimeBuckets, MaxTTL: maxTTL},
		inbox.Config{DefaultTTL: maxTTL}, workers)
	bucketLoad(b, bucketPG, rows, "now() + interval '40 minutes'", false)
	on := func(l *inbox.Ledger, tag string) func(round, i int) error {
		return func(round, i int) error {
			reqs := make([]inbox.Request, size)
			for j := range reqs {
				reqs[j] = inbox.Request{Key: inbox.Key{Scope: "batch", ID: tag + strconv.Itoa(round) + "-" + strconv.Itoa(i) + "-" + strconv.Itoa(j)}}
			}
			return op(l, reqs)
		}
	}
	b.ResetTimer()
	rounds, perRound := sized(20, 2), sized(40, 4)
	var took [][]time.Duration
	for n := 0; n < b.N; n++ {
		took = interleave(b, workers, n*rounds, rounds, perRound, on(plain, "p"), on(buckets, "b"))
	}
	b.StopTimer()
	b.ReportMetric(rate(took[0], perRound)*float64(size), "plain-msgs/s")
	b.ReportMetric(rate(took[1], perRound)*float64(size), "msgs/s")
	b.ReportMetric(speedRatio(took[1], took[0]), "ratio")
}

// doPayment is Do of k with a handler that inserts one payment, named by
// k's ID, and records no result (ledger_test's pay records one).
func doPayment(l *inbox.Ledger, k inbox.Key) error {
	_, err := l.Do(context.Background(), inbox.Request{Key: k}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, k.ID)
		return inbox.Result{}, err
	})
	return err
}

// claimDo is doPayment on keys tagged tag.
func claimDo(l *inbox.Ledger, tag string) func(round, i int) error {
	return func(round, i int) error {
		return doPayment(l, inbox.Key{Scope: "claims", ID: tag + strconv.Itoa(round) + "-" + strconv.Itoa(i)})
	}
}

// claimSpread is doPayment on keys of the loaded rows' scope whose IDs sort
// among theirs: "evt-" and a number past the rows loaded (so never one of
// theirs), scrambled so that consecutive calls land far apart in the
// index. Call i of round r is the (r × perRound + i)-th key; the scramble
// (an odd multiplier modulo 2^32) gives every call its own number.
func claimSpread(l *inbox.Ledger, rows, perRound int) func(round, i int) error {
	return func(round, i int) error {
		n := uint32(round*perRound+i) * 2654435761
		return doPayment(l, inbox.Key{Scope: "bulk", ID: "evt-" + strconv.FormatUint(uint64(rows)+1+uint64(n), 10)})
	}
}

// retentionRun is one layout's share of BenchmarkRetentionUnderLoad.
type retentionRun struct {
	quietRate, busyRate float64
	quiet, busy         []time.Duration
	purgeTook           atomic.Int64 // ns; 0 until the expired rows are gone
}

// BenchmarkRetentionUnderLoad: insert throughput and p99 of Do (4 workers)
// quiet (before and after, no janitor), and while retention runs: from the
// janitor's start until the JUSTONCE_BENCH_EXPIRED expired rows (default 1
// million) are gone, and at least as many calls as a quiet phase makes. The
// janitor runs every 250 ms (a fraction of its one-minute default), with
// its production settings otherwise. On the plain layout it deletes the
// rows in batches (of 1000, 1 ms apart); on the time-bucket layout it
// detaches the buckets that hold them as they fall due, one shard's a
// second (dueOldBuckets), and drops their tables once no bucket view can
// name them (the busy phase lasts until the tables are gone). Both layouts
// in one run.
func BenchmarkRetentionUnderLoad(b *testing.B) {
	expired := envInt("JUSTONCE_BENCH_EXPIRED", 1_000_000)
	n := max(b.N, 5000)
	run := func(l *inbox.Ledger, deleted *atomic.Int64, prepare func(), purged func() bool) *retentionRun {
		r := &retentionRun{}
		r.quietRate, r.quiet = latencies(b, l, "quiet-", 4, n)
		prepare()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		t0 := time.Now()
		go func() {
			defer close(done)
			t := time.NewTicker(250 * time.Millisecond)
			defer t.Stop()
			for {
				n, err := l.Purge(ctx, inbox.JanitorConfig{BatchSize: 1000, Pause: time.Millisecond})
				if deleted != nil {
					deleted.Add(n)
				}
				if err != nil && ctx.Err() == nil {
					b.Error(err)
					return
				}
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		}()
		r.busyRate, r.busy = latenciesUntil(b, l, "busy-", 4, n, func() bool {
			if r.purgeTook.Load() == 0 && purged() {
				r.purgeTook.Store(int64(time.Since(t0)))
			}
			return r.purgeTook.Load() != 0 || b.Failed()
		})
		cancel()
		<-done
		require.NotZero(b, r.purgeTook.Load(), "the expired rows are gone")
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
	const maxTTL = 40 * time.Second
	bucketPG, buckets := benchLedger(b, migrations.Config{Layout: migrations.LayoutTimeBuckets,
		MaxTTL: maxTTL}, inbox.Config{DefaultTTL: maxTTL}, 9)
	// All expired rows in the shards' older buckets, due to be dropped.
	bucketLoad(b, bucketPG, expired, "now() - interval '5 seconds'", true)

	// Whether the retention work is done, cheaply (the benchmark polls it
	// during the busy phase): on the plain layout the janitor has deleted
	// as many rows as expired; on the time-bucket layout no closed bucket
	// and no table of a detached one is left. After the phase, a count
	// confirms that no expired row is left.
	var deleted atomic.Int64
	plainGone := func() bool { return deleted.Load() >= int64(expired) }
	bucketsGone := func() bool {
		return bucketPG.Count(b, `SELECT count(*) FROM processed_events_buckets WHERE closed_at IS NOT NULL`) == 0 &&
			bucketPG.Count(b, `SELECT count(*) FROM pg_class WHERE relname ~ '^processed_events_b[0-9]+$'
				AND relkind = 'r' AND NOT relispartition
				AND relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'processed_events'::regclass)`) == 0
	}
	b.ResetTimer()
	// Buckets first: the plain purge leaves autovacuum work behind, which
	// would run during the other layout's measurement.
	q := run(buckets, nil, func() { dueOldBuckets(b, bucketPG) }, bucketsGone)
	p := run(plain, &deleted, func() {}, plainGone)
	for _, pg := range []*testsvc.PG{bucketPG, plainPG} {
		require.Zero(b, pg.Count(b, `SELECT count(*) FROM processed_events WHERE scope = 'bulk'`), "expired rows left")
	}
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
		b.ReportMetric(float64(len(x.r.busy)), x.tag+"-busy-calls")
	}
}

// BenchmarkRetentionWeek: a week of steady traffic in scaled time, on both
// layouts one after the other: a "day" is the TTL and MaxTTL
// (JUSTONCE_BENCH_DAY_S seconds, default 12), buckets have the default
// width (a day) and shards (JUSTONCE_BENCH_SHARDS overrides them), traffic is
// JUSTONCE_BENCH_RATE Do calls a second (default 1500) on 4 workers, and
// the janitor runs every 250 ms. After two days of filling (a shard of the
// time-bucket layout keeps up to two widths of rows) it measures a week,
// days 3–9: table + index size (swing around the mean, and the last day's
// mean against the first's), and the p99 of calls that started while a
// purge ran against those that did not.
func BenchmarkRetentionWeek(b *testing.B) {
	day := time.Duration(envInt("JUSTONCE_BENCH_DAY_S", 12)) * time.Second
	rate := envInt("JUSTONCE_BENCH_RATE", 1500)
	for _, lay := range []struct {
		tag string
		mc  migrations.Config
	}{
		{"plain", migrations.Config{}},
		{"buckets", migrations.Config{Layout: migrations.LayoutTimeBuckets, MaxTTL: day,
			Shards: envInt("JUSTONCE_BENCH_SHARDS", 0)}},
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
		// Two days to fill (on the time-bucket layout a shard keeps up to
		// two widths of rows), then a week measured.
		end := start.Add(9 * day)
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
					if time.Since(start) > 2*day { // after the fill
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
			if since := time.Since(start); since > 2*day {
				var sz int64
				require.NoError(b, pg.Pool.QueryRow(ctx,
					// The table, its buckets, and detached buckets not yet dropped.
					`SELECT sum(pg_total_relation_size(c.oid))::bigint FROM pg_class c
					WHERE c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'processed_events'::regclass)
						AND c.relkind IN ('r', 'p') AND (c.relname = 'processed_events' OR c.relname ~ '^processed_events_b[0-9]+$')`).Scan(&sz))
				sizes = append(sizes, sample{since, float64(sz)})
			}
		}
		cancel()
		wg.Wait()
		minS, maxS, sum := sizes[0].bytes, sizes[0].bytes, 0.0
		var first, last []float64 // the measured week's first and last day
		for _, s := range sizes {
			minS, maxS, sum = min(minS, s.bytes), max(maxS, s.bytes), sum+s.bytes
			if s.at < 3*day {
				first = append(first, s.bytes)
			}
			if s.at > 8*day {
				last = append(last, s.bytes)
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
		b.ReportMetric(avg(last)/avg(first), lay.tag+"-size-last/first-day")
		if len(quiet) > 0 && len(duringPurge) > 0 {
			b.ReportMetric(float64(pct(duringPurge, 0.99))/float64(pct(quiet, 0.99)), lay.tag+"-p99-purging/quiet")
			b.ReportMetric(float64(len(duringPurge))/float64(len(duringPurge)+len(quiet))*100, lay.tag+"-calls-during-purge-%")
		}
	}
}

// steadyRun is one layout's share of BenchmarkClaimSteadyState.
type steadyRun struct {
	took    []time.Duration // the Do calls completed in the measured windows
	window  time.Duration   // the windows' total length
	retired int64           // rows the janitor deleted (plain) or buckets it dropped, in the windows
}

func (r steadyRun) rate() float64 { return float64(len(r.took)) / r.window.Seconds() }

// BenchmarkClaimSteadyState: Do with a one-insert handler on 8 workers, as
// fast as it goes, on each layout alone in steady state: every key expires
// JUSTONCE_BENCH_TTL_S seconds after its claim (default 30; the time-bucket
// layout's MaxTTL and bucket width), and the janitor (production settings,
// every 250 ms) retires keys at the rate they come in: the plain table
// deletes them in batches, the time-bucket layout opens and drops whole
// buckets. Each run fills a fresh ledger for two TTLs (a shard keeps up to
// two widths of rows), then measures one TTL; the layouts run in the order
// plain, buckets, buckets, plain, so that a drift over the run (the
// database growing, checkpoints) weighs on both alike. It reports each
// layout's throughput and p99 over its measured TTLs, their ratio, and
// what retention did meanwhile (plain: rows deleted per call, about 1 in
// steady state; buckets: buckets dropped, one a shard in a width).
// BenchmarkClaimBucketsVsPlain measures the claims with no retention.
func BenchmarkClaimSteadyState(b *testing.B) {
	ttl := time.Duration(envInt("JUSTONCE_BENCH_TTL_S", sized(30, 4))) * time.Second
	const workers = 8
	var runs [2]steadyRun
	for _, k := range []int{0, 1, 1, 0} {
		mc := migrations.Config{}
		if k == 1 {
			mc = migrations.Config{Layout: migrations.LayoutTimeBuckets, MaxTTL: ttl}
		}
		pg, l := benchLedger(b, mc, inbox.Config{DefaultTTL: ttl}, workers)
		r := steadyClaims(b, pg, l, workers, ttl, k == 1)
		runs[k].took = append(runs[k].took, r.took...)
		runs[k].window += r.window
		runs[k].retired += r.retired
	}
	plain, buckets := runs[0], runs[1]
	for _, r := range runs {
		sort.Slice(r.took, func(i, j int) bool { return r.took[i] < r.took[j] })
	}
	b.ReportMetric(plain.rate(), "plain-ops/s")
	b.ReportMetric(buckets.rate(), "ops/s")
	b.ReportMetric(buckets.rate()/plain.rate(), "ratio")
	b.ReportMetric(float64(pct(buckets.took, 0.99))/float64(pct(plain.took, 0.99)), "p99-ratio")
	b.ReportMetric(float64(plain.retired)/float64(len(plain.took)), "plain-deleted/call")
	b.ReportMetric(float64(buckets.retired), "buckets-dropped")
}

// steadyClaims runs BenchmarkClaimSteadyState on one ledger.
func steadyClaims(b *testing.B, pg *testsvc.PG, l *inbox.Ledger, workers int, ttl time.Duration, buckets bool) steadyRun {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	bucketsGone := func() int64 {
		// Every bucket opened (a shard's ids go up by the shard count
		// from the shard's number, and its newest stays listed) less
		// those still attached.
		return int64(pg.Count(b, `SELECT (SELECT sum((m - shard) / l.shards + 1) FROM (SELECT shard, max(id) AS m
				FROM processed_events_buckets GROUP BY shard) s)
			- (SELECT count(*) FROM processed_events_buckets WHERE detached_at IS NULL)
			FROM processed_events_layout l`))
	}
	start := time.Now()
	from, to := start.Add(2*ttl), start.Add(3*ttl)
	var retired atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the janitor
		defer wg.Done()
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for time.Now().Before(to) {
			n, err := l.Purge(ctx, inbox.JanitorConfig{})
			if err != nil {
				b.Error(err)
				return
			}
			if now := time.Now(); !buckets && now.After(from) && now.Before(to) {
				retired.Add(n)
			}
			<-t.C
		}
	}()
	var mu sync.Mutex
	var took []time.Duration
	var next atomic.Int64
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			do := claimDo(l, "s")
			for time.Now().Before(to) {
				t0 := time.Now()
				if err := do(0, int(next.Add(1))); err != nil {
					b.Error(err)
					return
				}
				if t0.After(from) && time.Now().Before(to) {
					d := time.Since(t0)
					mu.Lock()
					took = append(took, d)
					mu.Unlock()
				}
			}
		}()
	}
	var droppedBefore int64
	if buckets {
		time.Sleep(time.Until(from))
		droppedBefore = bucketsGone()
	}
	wg.Wait()
	require.NotEmpty(b, took, "no call completed in the measured window")
	if buckets {
		retired.Store(bucketsGone() - droppedBefore)
	}
	return steadyRun{took: took, window: ttl, retired: retired.Load()}
}
