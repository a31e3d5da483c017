package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// TestCountNewKeyUnderContention: 24 handlers of one tenant's new keys run
// at once (each waits in its transaction until all have counted), under a
// limit of 5 per window. Exactly 5 commit; the others are refused and
// leave no ledger row and no business write. With Redis the count refuses
// them before they write; on Postgres alone every handler passed the
// check (none had committed yet), so the count's CHECK refuses the extra
// ones at commit: the contention is real.
func TestCountNewKeyUnderContention(t *testing.T) {
	t.Parallel()
	for _, withRedis := range []bool{false, true} {
		name := "postgres"
		if withRedis {
			name = "redis"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var b *bundle
			if withRedis {
				b = redisLedger(t, inbox.RedisConfig{})
			} else {
				b = setup(t, inbox.Config{}, testsvc.MaxConns(30))
			}
			rate := inbox.KeyRate{Limit: func(tenant string) int64 { return 5 }, Window: time.Hour}
			const n = 24
			ctx := context.Background()
			var counted sync.WaitGroup
			counted.Add(n)
			var refusedEarly, refusedAtCommit, executed atomic.Int64
			var wg sync.WaitGroup
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					var count *inbox.NewKeyCount
					id := fmt.Sprintf("k%d", i)
					r := inbox.Request{Key: inbox.Key{Scope: "orders", Tenant: "acme", ID: id}}
					out, err := b.ledger.Do(ctx, r, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
						var err error
						count, err = b.ledger.CountNewKey(ctx, tx, rate, "orders", "acme")
						counted.Done()
						if err != nil {
							return inbox.Result{}, err
						}
						counted.Wait() // every handler is in its transaction
						_, err = tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 1)`, id)
						return inbox.Result{}, err
					})
					var kre *inbox.KeyRateError
					switch {
					case err == nil && out.Disposition == inbox.Executed:
						executed.Add(1)
					case errors.As(err, &kre):
						require.ErrorIs(t, err, inbox.ErrKeyRate)
						require.Equal(t, int64(5), kre.Limit)
						require.Positive(t, kre.RetryAfter)
						require.LessOrEqual(t, kre.RetryAfter, time.Hour)
						refusedEarly.Add(1)
					default:
						_, ok := count.Refused(err)
						require.True(t, ok, "%v", err)
						refusedAtCommit.Add(1)
					}
				}()
			}
			wg.Wait()
			require.EqualValues(t, 5, executed.Load())
			require.EqualValues(t, n-5, refusedEarly.Load()+refusedAtCommit.Load())
			require.Equal(t, 5, b.pg.Count(t, `SELECT count(*) FROM payments`))
			require.Equal(t, 5, b.pg.Count(t, `SELECT count(*) FROM processed_events`), "a refused key leaves no row")
			if withRedis {
				require.EqualValues(t, n-5, refusedEarly.Load(), "Redis refuses before the handler writes")
				require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM key_rate`), "Redis holds the count")
			} else {
				require.EqualValues(t, n-5, refusedAtCommit.Load(), "every handler passed the check: the commit refused")
				require.Equal(t, 5, b.pg.Count(t, `SELECT keys FROM key_rate WHERE name = 'orders' AND tenant = 'acme'`))
			}

			// Once at the limit, a new key is refused before its handler
			// runs; another tenant, and another count name, are not.
			_, err := b.ledger.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "orders", Tenant: "acme", ID: "late"}},
				func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
					_, err := b.ledger.CountNewKey(ctx, tx, rate, "orders", "acme")
					return inbox.Result{}, err
				})
			require.ErrorIs(t, err, inbox.ErrKeyRate)
			for _, c := range []struct{ name, tenant string }{{"orders", "globex"}, {"refunds", "acme"}} {
				count, err := b.ledger.CountNewKey(ctx, nil, rate, c.name, c.tenant)
				require.NoError(t, err, c)
				count.Undo(ctx)
			}
		})
	}
}

// TestCountNewKeyUndoAndWindows: a count taken outside a transaction (a
// lease) is taken back by Undo; a new window starts the count afresh; a
// limit of 0 counts nothing.
func TestCountNewKeyUndoAndWindows(t *testing.T) {
	t.Parallel()
	for _, withRedis := range []bool{false, true} {
		t.Run(fmt.Sprint("redis=", withRedis), func(t *testing.T) {
			t.Parallel()
			var b *bundle
			if withRedis {
				b = redisLedger(t, inbox.RedisConfig{})
			} else {
				b = setup(t, inbox.Config{})
			}
			ctx := context.Background()
			rate := inbox.KeyRate{Limit: func(string) int64 { return 2 }, Window: 300 * time.Millisecond, Name: "shared"}
			// Start at the beginning of a window, so that the three calls
			// below fall in one.
			time.Sleep(time.Until(time.UnixMilli((time.Now().UnixMilli()/300 + 1) * 300)))
			first, err := b.ledger.CountNewKey(ctx, nil, rate, "ignored", "t")
			require.NoError(t, err)
			_, err = b.ledger.CountNewKey(ctx, nil, rate, "ignored", "t")
			require.NoError(t, err)
			_, err = b.ledger.CountNewKey(ctx, nil, rate, "other-scope", "t")
			var kre *inbox.KeyRateError
			require.ErrorAs(t, err, &kre, "Name shares the count across scopes")
			require.Equal(t, "shared", kre.Name)
			first.Undo(ctx)
			_, err = b.ledger.CountNewKey(ctx, nil, rate, "ignored", "t")
			require.NoError(t, err, "the undone count is free again")
			testsvc.Eventually(t, 5*time.Second, func() bool {
				c, err := b.ledger.CountNewKey(ctx, nil, rate, "ignored", "t")
				c.Undo(ctx)
				return err == nil
			}, "a new window counts afresh")

			none := inbox.KeyRate{Limit: func(string) int64 { return 0 }}
			for i := 0; i < 3; i++ {
				_, err := b.ledger.CountNewKey(ctx, nil, none, "n", "t")
				require.NoError(t, err)
			}
			require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM key_rate WHERE name = 'n'`))
		})
	}
}

func TestKeyRateValidate(t *testing.T) {
	t.Parallel()
	limit := func(string) int64 { return 1 }
	require.NoError(t, inbox.KeyRate{Limit: limit}.Validate())
	for _, r := range []inbox.KeyRate{{}, {Limit: limit, Window: -time.Second}, {Limit: limit, Window: time.Microsecond}} {
		require.ErrorIs(t, r.Validate(), inbox.ErrConfig)
	}
}
