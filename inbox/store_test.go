package inbox_test

import (
	"context"
	"fmt"
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

// The ledger's look-ups read every column the migrations declare but the
// key's (and, on the time-bucket layout, the bucket's), in the table's
// order, and the result's clock of migration 6, through which they mask a
// result past it: a column added to 001_processed_events.up.sql and not to
// the stores' column list fails it.
func TestLookupReadsEveryColumn(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b := setupLayout(t, mc, inbox.Config{})
		rows, err := b.pg.Pool.Query(context.Background(), `SELECT column_name::text FROM information_schema.columns
			WHERE table_schema = $1 AND table_name = 'processed_events' ORDER BY ordinal_position`, b.pg.Schema)
		require.NoError(t, err)
		cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		want := append(append([]string{"scope", "tenant", "event_id"}, inbox.RowColumns()...), "result_expires_at")
		if mc.Layout == migrations.LayoutTimeBuckets {
			want = append(want, "bucket")
		}
		require.Equal(t, want, cols)
	})
}

// A ledger's first calls, more of them at once than its pool has
// connections, all complete: while one of them finds out the ledger's
// layout through the pool, the others, each holding a connection of the
// pool, do not wait on it. The first caller (a lease claim without
// AcquireWait, which takes its connections from the pool as it goes) is
// held at the start of finding out until the others hold every connection
// of the pool (or have finished); a ledger whose other callers waited on
// that finding out while holding their connections would leave it none.
func TestFirstCallsBeyondThePoolDoNotStall(t *testing.T) {
	t.Parallel()
	const conns, others = 2, 6
	b := setup(t, inbox.Config{}, testsvc.MaxConns(conns))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	var opens, finished atomic.Int32
	firstOpening := make(chan struct{})
	var sawFull atomic.Bool
	b.ledger.OnStoreOpen(func() {
		if opens.Add(1) != 1 {
			return
		}
		close(firstOpening)
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) && finished.Load() < others {
			if b.pg.Pool.Stat().AcquiredConns() == conns {
				sawFull.Store(true)
				return
			}
			time.Sleep(time.Millisecond)
		}
	})

	leaseErr := make(chan error, 1)
	go func() {
		lease, _, err := b.ledger.AcquireLease(ctx, req("orders", "first"), time.Minute)
		if err == nil {
			err = lease.Complete(ctx, inbox.Result{})
		}
		leaseErr <- err
	}()
	<-firstOpening
	var wg sync.WaitGroup
	errs := make(chan error, others)
	for i := range others {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer finished.Add(1)
			_, err := b.ledger.Do(ctx, req("orders", fmt.Sprintf("burst-%d", i)), pay(fmt.Sprintf("burst-%d", i), nil))
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.NoError(t, <-leaseErr)
	require.True(t, sawFull.Load() || finished.Load() == others, "the first caller was held until the pool was full")
	require.Greater(t, opens.Load(), int32(1), "the other callers found the layout out while the first was held")
	var n int
	require.NoError(t, b.pg.Pool.QueryRow(context.Background(), `SELECT count(*) FROM payments`).Scan(&n))
	require.Equal(t, others, n)
}
