package inbox_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// benchProvider is a payment provider on loopback that charges once per
// idempotency key, as the payment handlers of the steps benchmarks call it.
func benchProvider(b *testing.B) (url string, client *http.Client) {
	b.Helper()
	var mu sync.Mutex
	charges := map[string]string{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		_, _ = io.Copy(io.Discard, r.Body)
		mu.Lock()
		id, ok := charges[key]
		if !ok {
			id = fmt.Sprintf("ch_%024d", len(charges)+1) // a provider's ID, 27 bytes
			charges[key] = id
		}
		mu.Unlock()
		_, _ = io.WriteString(w, id)
	}))
	b.Cleanup(srv.Close)
	return srv.URL, srv.Client()
}

// benchCharge calls the provider with key.
func benchCharge(ctx context.Context, client *http.Client, url, key, payment string) ([]byte, error) {
	r, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(payment))
	if err != nil {
		return nil, err
	}
	r.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(r)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	return io.ReadAll(resp.Body)
}

// stepsPayment is the payment handler of three steps: the order row (a
// Postgres step), the charge at the provider (an outside call), the
// receipt row (a Postgres step).
func stepsPayment(client *http.Client, url, id string) inbox.StepsFunc {
	return func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		order, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO bench_orders (payment) VALUES ($1)`, id)
			return []byte(id), err
		})
		if err != nil {
			return inbox.Result{}, err
		}
		charge, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			return benchCharge(ctx, client, url, key, string(order))
		})
		if err != nil {
			return inbox.Result{}, err
		}
		_, err = s.Tx(ctx, "receipt", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO bench_receipts (payment, charge) VALUES ($1, $2)`, id, string(charge))
			return nil, err
		})
		return inbox.Result{Code: 201, Body: charge}, err
	}
}

// leasedPayment is the same three effects under one lease (DoLeased): the
// rows written straight on the pool, the charge with the request's key.
func leasedPayment(pool *pgxpool.Pool, client *http.Client, url, id string) inbox.LeaseFunc {
	return func(ctx context.Context, _ int64) (inbox.Result, error) {
		if _, err := pool.Exec(ctx, `INSERT INTO bench_orders (payment) VALUES ($1)`, id); err != nil {
			return inbox.Result{}, err
		}
		charge, err := benchCharge(ctx, client, url, "lease-"+id, id)
		if err != nil {
			return inbox.Result{}, err
		}
		_, err = pool.Exec(ctx, `INSERT INTO bench_receipts (payment, charge) VALUES ($1, $2)`, id, string(charge))
		return inbox.Result{Code: 201, Body: charge}, err
	}
}

func stepsBenchLedger(b *testing.B, conns int32) (*testsvc.PG, *inbox.Ledger) {
	b.Helper()
	pg := testsvc.Postgres(b, testsvc.MaxConns(conns))
	pg.Exec(b, `CREATE TABLE bench_orders (payment text NOT NULL)`)
	pg.Exec(b, `CREATE TABLE bench_receipts (payment text NOT NULL, charge text NOT NULL)`)
	// The ledger's pool counts the round trips of the calls whose context
	// carries a counter (roundTrips).
	cfg, err := pgxpool.ParseConfig(pg.URL)
	require.NoError(b, err)
	cfg.MaxConns = conns
	cfg.ConnConfig.Tracer = roundTrips{}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(b, err)
	b.Cleanup(pool.Close)
	pg.Pool = pool
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(b, err)
	return pg, l
}

// roundTrips is a pgx tracer that counts the statements and batches sent
// (one round trip each once their statements are prepared) into the
// counter their context carries (withRoundTrips).
type roundTrips struct{}

type roundTripsKey struct{}

func withRoundTrips(ctx context.Context, n *atomic.Int64) context.Context {
	return context.WithValue(ctx, roundTripsKey{}, n)
}

func (roundTrips) count(ctx context.Context) context.Context {
	if n, ok := ctx.Value(roundTripsKey{}).(*atomic.Int64); ok {
		n.Add(1)
	}
	return ctx
}

func (t roundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return t.count(ctx)
}
func (roundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (t roundTrips) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return t.count(ctx)
}
func (roundTrips) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}
func (roundTrips) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)     {}

// BenchmarkStepsVsLeased: a payment of three effects (an order row, a
// charge at a provider over HTTP on loopback, a receipt row) under one
// lease (DoLeased: base, at least once as a whole) and in three steps
// (DoSteps: subject; the rows exactly once, the charge deduplicated by
// its step's key, each recorded), at 1 and 8 connections, interleaved.
// ratio is the steps' throughput over the lease's. DoSteps adds, per key,
// the steps' load after the claim (one round trip), BEGIN of each
// Postgres step (one each; its record travels with its COMMIT) and the
// record of the call (one).
func BenchmarkStepsVsLeased(b *testing.B) {
	for _, conns := range []int{1, 8} {
		b.Run(fmt.Sprintf("conns=%d", conns), func(b *testing.B) {
			pg, l := stepsBenchLedger(b, int32(conns))
			url, client := benchProvider(b)
			var leasedTrips, stepsTrips, leasedN, stepsN atomic.Int64
			leasedCtx := withRoundTrips(context.Background(), &leasedTrips)
			stepsCtx := withRoundTrips(context.Background(), &stepsTrips)
			id := func(kind string, r, i int) string { return kind + "-" + strconv.Itoa(r) + "-" + strconv.Itoa(i) }
			defer func() {
				b.ReportMetric(float64(leasedTrips.Load())/float64(leasedN.Load()), "base-round-trips/op")
				b.ReportMetric(float64(stepsTrips.Load())/float64(stepsN.Load()), "round-trips/op")
			}()
			b.ResetTimer()
			compareFloor(b, conns, sized(30, 2), sized(20*conns, 10),
				func(r, i int) error {
					ctx := leasedCtx
					leasedN.Add(1)
					id := id("leased", r, i)
					out, err := l.DoLeased(ctx, inbox.Request{Key: inbox.Key{Scope: "perf", ID: id}}, 0, leasedPayment(pg.Pool, client, url, id))
					if err == nil && out.Disposition != inbox.Executed {
						err = fmt.Errorf("unexpected %v", out.Disposition)
					}
					return err
				}, nil,
				func(r, i int) error {
					ctx := stepsCtx
					stepsN.Add(1)
					id := id("steps", r, i)
					out, err := l.DoSteps(ctx, inbox.Request{Key: inbox.Key{Scope: "perf", ID: id}}, 0, stepsPayment(client, url, id))
					if err == nil && out.Disposition != inbox.Executed {
						err = fmt.Errorf("unexpected %v", out.Disposition)
					}
					return err
				})
		})
	}
}

// BenchmarkStepsStorage: what recording steps costs in the database: the
// payments of BenchmarkStepsVsLeased (outputs of 12 and 27 bytes and
// none), 10,000 keys (1,000 under JUSTONCE_BENCH_SMALL, scaled), and the
// size of processed_steps (pg_total_relation_size: heap, indexes, TOAST)
// per 10,000 keys, beside that of processed_events for the same keys.
func BenchmarkStepsStorage(b *testing.B) {
	keys := sized(10000, 1000)
	for n := 0; n < b.N; n++ {
		b.StopTimer()
		pg, l := stepsBenchLedger(b, 8)
		url, client := benchProvider(b)
		ctx := context.Background()
		b.StartTimer()
		start := time.Now()
		_, err := runTimed(8, keys, func(i int) error {
			id := fmt.Sprintf("pay-%07d", i)
			_, err := l.DoSteps(ctx, inbox.Request{Key: inbox.Key{Scope: "perf", ID: id}}, 0, stepsPayment(client, url, id))
			return err
		})
		require.NoError(b, err)
		took := time.Since(start)
		b.StopTimer()
		pg.Exec(b, `VACUUM ANALYZE processed_steps`)
		pg.Exec(b, `VACUUM ANALYZE processed_events`)
		size := func(table string) float64 {
			var s int64
			require.NoError(b, pg.Pool.QueryRow(ctx, `SELECT pg_total_relation_size($1::regclass)`, table).Scan(&s))
			return float64(s) * 10000 / float64(keys)
		}
		rows := pg.Count(b, `SELECT count(*) FROM processed_steps`)
		b.ReportMetric(float64(rows)/float64(keys), "step-rows/key")
		b.ReportMetric(size("processed_steps"), "steps-bytes/10k-keys")
		b.ReportMetric(size("processed_events"), "ledger-bytes/10k-keys")
		b.ReportMetric(float64(keys)/took.Seconds(), "keys/s")
		b.StartTimer()
	}
}
