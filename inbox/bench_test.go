package inbox_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
)

// runMeasured runs n operations on workers goroutines and returns ops/s.
func runMeasured(workers, n int, op func(i int) error) (float64, error) {
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
	return float64(n) / time.Since(start).Seconds(), firstErr
}

// compare runs base and subject alternately in rounds, in one process, and
// reports both throughputs and their ratio (subject/base).
func compare(b *testing.B, workers, perRound int, base, subject func(round, i int) error) {
	b.Helper()
	compareFloor(b, workers, perRound, base, nil, subject)
}

// compareFloor is compare with an optional third variant, floor, reported
// as floor-ops/s and ratio-vs-floor.
func compareFloor(b *testing.B, workers, perRound int, base, floor, subject func(round, i int) error) {
	b.Helper()
	rounds := max(b.N/perRound, 1)
	var baseRate, floorRate, subjRate float64
	measure := func(f func(round, i int) error, r int) float64 {
		rate, err := runMeasured(workers, perRound, func(i int) error { return f(r, i) })
		require.NoError(b, err)
		return rate
	}
	for r := 0; r < rounds; r++ {
		baseRate += measure(base, r)
		if floor != nil {
			floorRate += measure(floor, r)
		}
		subjRate += measure(subject, r)
	}
	baseRate /= float64(rounds)
	subjRate /= float64(rounds)
	b.ReportMetric(baseRate, "base-ops/s")
	b.ReportMetric(subjRate, "ops/s")
	b.ReportMetric(subjRate/baseRate, "ratio")
	if floor != nil {
		floorRate /= float64(rounds)
		b.ReportMetric(floorRate, "floor-ops/s")
		b.ReportMetric(subjRate/floorRate, "ratio-vs-floor")
	}
	b.ReportMetric(1e9/subjRate, "ns/op")
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
				bt.Queue(`INSERT INTO floor_ledger (scope, tenant, event_id, status, expires_at) VALUES ('bench', '', $1, 'done', now() + interval '1 day')`, id)
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
			compareFloor(b, conns, 2000,
				func(r, i int) error {
					return pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error {
						_, err := tx.Exec(ctx, `INSERT INTO bare_payments (id, amount) VALUES ($1, 100)`, strconv.Itoa(r)+"-"+strconv.Itoa(i))
						return err
					})
				},
				floor,
				func(r, i int) error {
					id := strconv.Itoa(r) + "-" + strconv.Itoa(i)
					out, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "bench", ID: id}}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
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

// BenchmarkBatchVsPerEvent: 100 events a transaction through DoBatch,
// against the same events one transaction each through Do, and against a
// bare 100-insert transaction. Reports events/s and ratios.
func BenchmarkBatchVsPerEvent(b *testing.B) {
	const size = 100
	pg := testsvc.Postgres(b, testsvc.MaxConns(8))
	pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
	pg.Exec(b, `CREATE TABLE bare_payments (id text PRIMARY KEY, amount int NOT NULL)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	ctx := context.Background()
	var seq atomic.Int64
	batches := max(b.N/size, 8)
	b.ResetTimer()

	perEvent, err := runMeasured(8, batches*size/4, func(i int) error {
		id := "e-" + strconv.FormatInt(seq.Add(1), 10)
		_, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "bench", ID: id}}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, id)
			return inbox.Result{}, err
		})
		return err
	})
	require.NoError(b, err)

	batchRate, err := runMeasured(8, batches, func(i int) error {
		reqs := make([]inbox.Request, size)
		for j := range reqs {
			reqs[j] = inbox.Request{Key: inbox.Key{Scope: "bench", ID: "b-" + strconv.FormatInt(seq.Add(1), 10)}}
		}
		_, err := l.DoBatch(ctx, reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
			bt := &pgx.Batch{}
			for _, k := range fresh {
				bt.Queue(`INSERT INTO payments VALUES ($1, 1)`, reqs[k].ID)
			}
			return nil, tx.SendBatch(ctx, bt).Close()
		})
		return err
	})
	require.NoError(b, err)

	bareRate, err := runMeasured(8, batches, func(i int) error {
		return pgx.BeginFunc(ctx, pg.Pool, func(tx pgx.Tx) error {
			bt := &pgx.Batch{}
			for j := 0; j < size; j++ {
				bt.Queue(`INSERT INTO bare_payments VALUES ($1, 1)`, "x-"+strconv.FormatInt(seq.Add(1), 10))
			}
			return tx.SendBatch(ctx, bt).Close()
		})
	})
	require.NoError(b, err)
	b.ReportMetric(perEvent, "per-event-ev/s")
	b.ReportMetric(batchRate*size, "batch-ev/s")
	b.ReportMetric(bareRate*size, "bare-batch-ev/s")
	b.ReportMetric(batchRate*size/perEvent, "batch/per-event")
	b.ReportMetric(batchRate/bareRate, "batch/bare-batch")
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
		_, err := cached.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "bench", ID: strconv.Itoa(i)}}, func(context.Context, pgx.Tx) (inbox.Result, error) {
			return inbox.Result{Code: 201, Body: body}, nil
		})
		require.NoError(b, err)
	}
	dup := func(l *inbox.Ledger) func(r, i int) error {
		return func(r, i int) error {
			out, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "bench", ID: strconv.Itoa(i % keys)}}, func(context.Context, pgx.Tx) (inbox.Result, error) {
				return inbox.Result{}, fmt.Errorf("must not run")
			})
			if err == nil && out.Disposition != inbox.Duplicate {
				err = fmt.Errorf("unexpected %v", out.Disposition)
			}
			return err
		}
	}
	b.Run("replay", func(b *testing.B) { compare(b, 8, 2000, dup(pgOnly), dup(cached)) })

	// In flight: a lease holds the key in Postgres and a lock in Redis.
	held := inbox.Request{Key: inbox.Key{Scope: "bench", ID: "held"}}
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
	b.Run("in-flight", func(b *testing.B) { compare(b, 8, 2000, busy(pgOnly), busy(cached)) })
}
