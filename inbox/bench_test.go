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

// runTimed runs n operations on workers goroutines and returns how long
// they took.
func runTimed(workers, n int, op func(i int) error) (time.Duration, error) {
	var next atomic.Int64
	var firstErr error
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				if err := op(i); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return time.Since(start), firstErr
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

// interleave measures variants side by side: rounds rounds, each running
// perRound operations of every variant in turn on workers goroutines
// (rotating which goes first), so that a machine whose load changes
// during the run slows every variant alike. op(round, i) gets the round
// (first, first+1, ...) and the operation's index within it. It returns
// what each variant's operations took in each round. The work is fixed by
// rounds and perRound, not by b.N.
func interleave(b *testing.B, workers, first, rounds, perRound int, variants ...func(round, i int) error) [][]time.Duration {
	b.Helper()
	took := make([][]time.Duration, len(variants))
	for r := 0; r < rounds; r++ {
		for k := range variants {
			v := (r + k) % len(variants)
			d, err := runTimed(workers, perRound, func(i int) error { return variants[v](first+r, i) })
			require.NoError(b, err)
			took[v] = append(took[v], d)
		}
	}
	return took
}

// rate is a variant's throughput over all its rounds, in ops/s.
func rate(took []time.Duration, perRound int) float64 {
	var t time.Duration
	for _, d := range took {
		t += d
	}
	return float64(len(took)*perRound) / t.Seconds()
}

// speedRatio is the median over rounds of a's throughput divided by b's:
// a round hit by a burst of outside load moves it less than it moves a
// ratio of totals.
func speedRatio(a, b []time.Duration) float64 {
	xs := make([]float64, len(a))
	for r := range a {
		xs[r] = float64(b[r]) / float64(a[r])
	}
	sort.Float64s(xs)
	if n := len(xs); n%2 == 1 {
		return xs[n/2]
	} else {
		return (xs[n/2-1] + xs[n/2]) / 2
	}
}

// compare runs total operations each of base and subject, interleaved in
// 40 rounds (2 small rounds of 20 under JUSTONCE_BENCH_SMALL), and reports
// both throughputs and their ratio (subject/base).
func compare(b *testing.B, workers, total int, base, subject func(round, i int) error) {
	b.Helper()
	rounds := sized(40, 2)
	compareFloor(b, workers, rounds, sized(max(total/rounds, 1), 20), base, nil, subject)
}

// compareFloor is compare with an optional third variant, floor, reported
// as floor-ops/s and ratio-vs-floor (subject/floor).
func compareFloor(b *testing.B, workers, rounds, perRound int, base, floor, subject func(round, i int) error) {
	b.Helper()
	vs := []func(round, i int) error{base, subject}
	if floor != nil {
		vs = append(vs, floor)
	}
	var took [][]time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		took = interleave(b, workers, n*rounds, rounds, perRound, vs...)
	}
	b.StopTimer()
	b.ReportMetric(rate(took[0], perRound), "base-ops/s")
	b.ReportMetric(rate(took[1], perRound), "ops/s")
	b.ReportMetric(speedRatio(took[1], took[0]), "ratio")
	if floor != nil {
		b.ReportMetric(rate(took[2], perRound), "floor-ops/s")
		b.ReportMetric(speedRatio(took[1], took[2]), "ratio-vs-floor")
	}
	b.ReportMetric(1e9/rate(took[1], perRound), "ns/op")
}

// BenchmarkLedgerVsBare: the same one-INSERT handler bare in its own
// transaction (BEGIN; INSERT; COMMIT) and wrapped by Ledger.Do, at 1 and 8
// connections. Target: ratio ≥ 0.95. The floor variant is the bare
// transaction plus one more row written in the same round trips (BEGIN
// pipelined with an INSERT into a table shaped like processed_events): what
// any ledger that writes a row per event costs at least.
func BenchmarkLedgerVsBare(b *testing.B) {
	for _, conns := range []int{1, 8} {
		b.Run(fmt.Sprintf("conns=%d", conns), func(b *testing.B) {
			pg := testsvc.Postgres(b, testsvc.MaxConns(int32(conns)))
			pg.Exec(b, `CREATE TABLE bare_payments (id text PRIMARY KEY, amount int NOT NULL)`)
			pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
			pg.Exec(b, `CREATE TABLE floor_payments (id text PRIMARY KEY, amount int NOT NULL)`)
			pg.Exec(b, `CREATE TABLE floor_ledger (LIKE processed_events INCLUDING ALL)`)
			l, err := inbox.New(pg.Pool, inbox.Config{})
			require.NoError(b, err)
			ctx := context.Background()
			floor := func(r, i int) error {
				id := strconv.Itoa(r) + "-" + strconv.Itoa(i)
				c, err := pg.Pool.Acquire(ctx)
				if err != nil {
					return err
				}
				defer c.Release()
				bt := &pgx.Batch{}
				bt.Queue("BEGIN")
				bt.Queue(`INSERT INTO floor_ledger (scope, tenant, event_id, status, expires_at) VALUES ('perf', '', $1, 'done', now() + interval '1 day')`, id)
				if err := c.SendBatch(ctx, bt).Close(); err != nil {
					return err
				}
				if _, err := c.Exec(ctx, `INSERT INTO floor_payments (id, amount) VALUES ($1, 100)`, id); err != nil {
					return err
				}
				_, err = c.Exec(ctx, "COMMIT")
				return err
			}
			b.ResetTimer()
			compareFloor(b, conns, sized(40, 2), sized(25*conns, 10),
				func(r, i int) error {
					return pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error {
						_, err := tx.Exec(ctx, `INSERT INTO bare_payments (id, amount) VALUES ($1, 100)`, strconv.Itoa(r)+"-"+strconv.Itoa(i))
						return err
					})
				},
				floor,
				func(r, i int) error {
					id := strconv.Itoa(r) + "-" + strconv.Itoa(i)
					out, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "perf", ID: id}}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
						_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 100)`, id)
						return inbox.Result{}, err
					})
					if err == nil && out.Disposition != inbox.Executed {
						err = fmt.Errorf("unexpected %v", out.Disposition)
					}
					return err
				})
		})
	}
}

// BenchmarkBatchVsPerEvent: 100 events a transaction through DoBatch
// (subject), against a bare transaction inserting the same 100 business
// rows (base: ratio batch/bare-batch), and against the same events one
// transaction each through Do (batch/per-event). Measured interleaved, in
// a fixed number of rounds (see interleave). Target: batch/bare-batch
// ≥ 0.45 (DoBatch writes two rows per event, the bare batch one).
func BenchmarkBatchVsPerEvent(b *testing.B) {
	const size = 100
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
	pg.Exec(b, `CREATE TABLE bare_payments (id text PRIMARY KEY, amount int NOT NULL)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	ctx := context.Background()
	var seq atomic.Int64
	id := func(p string) string { return p + strconv.FormatInt(seq.Add(1), 10) }
	bare := func(_, _ int) error { // one op: a transaction of size inserts
		return pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error {
			bt := &pgx.Batch{}
			for j := 0; j < size; j++ {
				bt.Queue(`INSERT INTO bare_payments VALUES ($1, 1)`, id("x-"))
			}
			return tx.SendBatch(ctx, bt).Close()
		})
	}
	batch := func(_, _ int) error { // one op: DoBatch of size events
		reqs := make([]inbox.Request, size)
		for j := range reqs {
			reqs[j] = inbox.Request{Key: inbox.Key{Scope: "perf", ID: id("b-")}}
		}
		outs, err := l.DoBatch(ctx, reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
			bt := &pgx.Batch{}
			for _, k := range fresh {
				bt.Queue(`INSERT INTO payments VALUES ($1, 1)`, reqs[k].ID)
			}
			return nil, tx.SendBatch(ctx, bt).Close()
		})
		if err == nil && outs[size-1].Disposition != inbox.Executed {
			err = fmt.Errorf("unexpected %v", outs[size-1].Disposition)
		}
		return err
	}
	perEvent := func(_, _ int) error { // one op: size events, one Do each
		for j := 0; j < size; j++ {
			id := id("e-")
			_, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "perf", ID: id}}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, id)
				return inbox.Result{}, err
			})
			if err != nil {
				return err
			}
		}
		return nil
	}
	rounds, perRound := sized(20, 2), 8
	var took [][]time.Duration
	b.ResetTimer()
	for n := 0; n < b.N; n++ {
		took = interleave(b, 8, 0, rounds, perRound, bare, batch, perEvent)
	}
	b.StopTimer()
	b.ReportMetric(rate(took[2], perRound)*size, "per-event-ev/s")
	b.ReportMetric(rate(took[1], perRound)*size, "batch-ev/s")
	b.ReportMetric(rate(took[0], perRound)*size, "bare-batch-ev/s")
	b.ReportMetric(speedRatio(took[1], took[2]), "batch/per-event")
	b.ReportMetric(speedRatio(took[1], took[0]), "batch/bare-batch")
	b.ReportMetric(1e9/(rate(took[1], perRound)*size), "ns/op")
}

// BenchmarkDuplicateRedisVsPostgres: answering a duplicate from the Redis
// replay cache against from Postgres only, and turning an in-flight key
// away through Redis against through Postgres. Target: cache ≥ 3×.
func BenchmarkDuplicateRedisVsPostgres(b *testing.B) {
	const keys = 200
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
	client, prefix := testsvc.Redis(b)
	pgOnly, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	cached, err := inbox.New(pg.Pool, inbox.Config{Redis: &inbox.RedisConfig{Client: client, Prefix: prefix}})
	require.NoError(b, err)
	ctx := context.Background()
	body := []byte(`{"id":"pay_123","status":"succeeded","amount":1000,"currency":"eur"}`)
	for i := 0; i < keys; i++ {
		_, err := cached.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "perf", ID: strconv.Itoa(i)}}, func(context.Context, pgx.Tx) (inbox.Result, error) {
			return inbox.Result{Code: 201, Body: body}, nil
		})
		require.NoError(b, err)
	}
	dup := func(l *inbox.Ledger) func(r, i int) error {
		return func(r, i int) error {
			out, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "perf", ID: strconv.Itoa(i % keys)}}, func(context.Context, pgx.Tx) (inbox.Result, error) {
				return inbox.Result{}, fmt.Errorf("must not run")
			})
			if err == nil && out.Disposition != inbox.Duplicate {
				err = fmt.Errorf("unexpected %v", out.Disposition)
			}
			return err
		}
	}
	b.Run("replay", func(b *testing.B) { compare(b, 8, 4000, dup(pgOnly), dup(cached)) })

	// In flight: a lease holds the key in Postgres and a lock in Redis.
	held := inbox.Request{Key: inbox.Key{Scope: "perf", ID: "held"}}
	lease, _, err := pgOnly.AcquireLease(ctx, held, time.Hour)
	require.NoError(b, err)
	defer func() { _ = lease.Abandon(ctx) }()
	_, lockKey := cached.RedisKeys(held.Key)
	require.NoError(b, client.Set(ctx, lockKey, "holder", time.Hour).Err())
	defer client.Del(ctx, lockKey)
	busy := func(l *inbox.Ledger) func(r, i int) error {
		return func(r, i int) error {
			out, err := l.Do(ctx, held, func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, fmt.Errorf("must not run") })
			if err == nil && out.Disposition != inbox.InFlight {
				err = fmt.Errorf("unexpected %v", out.Disposition)
			}
			return err
		}
	}
	b.Run("in-flight", func(b *testing.B) { compare(b, 8, 4000, busy(pgOnly), busy(cached)) })
}
