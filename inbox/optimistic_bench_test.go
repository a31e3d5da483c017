package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// BenchmarkDoEachOptimistic: DoEach runs (the batched consumers' claim)
// with a one-insert handler, on the plain layout, with the optimistic path
// (subject) against every run on savepoints (base), interleaved (see
// interleave), 4 workers. Sub-benchmarks: size-N runs N new keys;
// dup-N runs the same N keys, done before
// the timing (a redelivered batch); fail-N runs N new
// keys whose handler of the last one fails (the optimistic transaction is
// rolled back and the others run again on savepoints). Metrics: each
// variant's messages/s and their ratio (optimistic/savepoints).
func BenchmarkDoEachOptimistic(b *testing.B) {
	for _, c := range []struct {
		name      string
		size      int
		dup, fail bool
	}{
		{"size-8", 8, false, false},
		{"size-50", 50, false, false},
		{"dup-50", 50, true, false},
		{"fail-8", 8, false, true},
	} {
		b.Run(c.name, func(b *testing.B) {
			const workers = 4
			pg := testsvc.Postgres(b, testsvc.MaxConns(workers))
			pg.Exec(b, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
			opt, err := inbox.New(pg.Pool, inbox.Config{})
			require.NoError(b, err)
			sp, err := inbox.New(pg.Pool, inbox.Config{})
			require.NoError(b, err)
			inbox.SetSavepointsOnly(opt, false)
			inbox.SetSavepointsOnly(sp, true)
			errFail := errors.New("fails")
			on := func(l *inbox.Ledger, tag string) func(round, i int) error {
				return func(round, i int) error {
					reqs := make([]inbox.Request, c.size)
					for j := range reqs {
						id := tag + strconv.Itoa(round) + "-" + strconv.Itoa(i) + "-" + strconv.Itoa(j)
						if c.dup {
							id = "dup-" + strconv.Itoa(j) // done before the timing
						}
						reqs[j] = inbox.Request{Key: inbox.Key{Scope: "each", ID: id}}
					}
					do := func(want int) error {
						run, err := l.DoEach(context.Background(), reqs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, k int) (inbox.Result, error) {
							if c.fail && k == len(reqs)-1 {
								return inbox.Result{}, errFail
							}
							_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, reqs[k].ID)
							return inbox.Result{}, err
						})
						if err == nil && len(run.Outcomes) != want {
							err = fmt.Errorf("%d outcomes, want %d", len(run.Outcomes), want)
						}
						if err == nil && c.fail && !errors.Is(run.Failed, errFail) {
							err = fmt.Errorf("failed: %v", run.Failed)
						}
						return err
					}
					return do(len(reqs))
				}
			}
			if c.dup {
				require.NoError(b, on(opt, "")(0, 0))
			}
			b.ResetTimer()
			rounds, perRound := sized(20, 2), sized(20, 4)
			var took [][]time.Duration
			for n := 0; n < b.N; n++ {
				took = interleave(b, workers, n*rounds, rounds, perRound, on(sp, "s"), on(opt, "o"))
			}
			b.StopTimer()
			b.ReportMetric(rate(took[0], perRound)*float64(c.size), "savepoints-msgs/s")
			b.ReportMetric(rate(took[1], perRound)*float64(c.size), "optimistic-msgs/s")
			b.ReportMetric(speedRatio(took[1], took[0]), "ratio")
		})
	}
}
