package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// layouts are the table layouts every test here runs on. The time-bucket
// one uses buckets of 2 s and a MaxTTL of 10 s (the ledgers' default TTL),
// so that buckets turn over while a test runs.
var layouts = []struct {
	name string
	cfg  migrations.Config
}{
	{"plain", migrations.Config{}},
	{"buckets", migrations.Config{Layout: migrations.LayoutTimeBuckets, BucketWidth: 2 * time.Second, MaxTTL: 10 * time.Second}},
}

// setupLayout is setup on a schema migrated with mc.
func setupLayout(t *testing.T, mc migrations.Config, cfg inbox.Config, opts ...testsvc.PGOption) *bundle {
	t.Helper()
	pg := testsvc.Postgres(t, append(opts, testsvc.NoMigrate())...)
	mc.Schema = pg.Schema
	if cfg.DefaultTTL == 0 && mc.MaxTTL != 0 {
		cfg.DefaultTTL = mc.MaxTTL
	}
	_, err := migrations.New(pg.Pool, mc).Up(context.Background())
	require.NoError(t, err)
	pg.Exec(t, `CREATE TABLE payments (id text PRIMARY KEY, amount int NOT NULL)`)
	l, err := inbox.New(pg.Pool, cfg)
	require.NoError(t, err)
	return &bundle{pg: pg, ledger: l}
}

func forLayouts(t *testing.T, f func(t *testing.T, mc migrations.Config)) {
	for _, lay := range layouts {
		t.Run(lay.name, func(t *testing.T) {
			t.Parallel()
			f(t, lay.cfg)
		})
	}
}

func noop(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil }

func TestLayoutsDuplicatesAndStoredResults(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b := setupLayout(t, mc, inbox.Config{})
		ctx := context.Background()
		var ran atomic.Int64
		for i := 0; i < 3; i++ {
			out, err := b.ledger.Do(ctx, req("orders", "evt-1"), pay("p1", &ran))
			require.NoError(t, err)
			if i == 0 {
				require.Equal(t, inbox.Executed, out.Disposition)
				continue
			}
			require.Equal(t, inbox.Duplicate, out.Disposition)
			require.Equal(t, 201, out.Result.Code)
			require.Equal(t, `{"id":"p1"}`, string(out.Result.Body))
		}
		require.EqualValues(t, 1, ran.Load())

		// DoTx and DoBatch see the same key, and each other's.
		tx, err := b.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		out, err := b.ledger.DoTx(ctx, tx, req("orders", "evt-1"), pay("p1", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		out, err = b.ledger.DoTx(ctx, tx, req("orders", "evt-2"), pay("p2", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
		require.NoError(t, tx.Commit(ctx))

		reqs := []inbox.Request{req("orders", "evt-1"), req("orders", "evt-2"), req("orders", "evt-3"), req("orders", "evt-3")}
		outs, err := b.ledger.DoBatch(ctx, reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
			require.Equal(t, []int{2}, fresh)
			return []inbox.Result{{Code: 202}}, nil
		})
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, outs[0].Disposition)
		require.Equal(t, 201, outs[0].Result.Code)
		require.Equal(t, inbox.Duplicate, outs[1].Disposition)
		require.Equal(t, inbox.Executed, outs[2].Disposition)
		require.Equal(t, inbox.Duplicate, outs[3].Disposition)
		st, err := b.ledger.Known(ctx, []inbox.Key{{Scope: "orders", ID: "evt-3"}, {Scope: "orders", ID: "nope"}})
		require.NoError(t, err)
		require.Equal(t, []inbox.Status{inbox.StatusDone, ""}, st)
		require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM payments`))
	})
}

func TestLayoutsConcurrentRacersRunOnce(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b := setupLayout(t, mc, inbox.Config{}, testsvc.MaxConns(20))
		ctx := context.Background()
		// Several keys, each raced by 25 callers mixing Do, DoBatch, DoEach
		// and leases, in two processes (ledgers), while the janitor of a
		// third opens buckets (2 s apart per shard, staggered: one shard's
		// every 250 ms) and the racers' views of them go stale. A DoEach
		// racer's run first claims another key of the same shard, so that
		// its transaction already writes into the shard's bucket when it
		// reaches the raced key.
		other, err := inbox.New(b.pg.Pool, inbox.Config{DefaultTTL: mc.MaxTTL})
		require.NoError(t, err)
		ledgers := []*inbox.Ledger{b.ledger, other}
		// Warm up, so that the racers start together: each ledger has
		// loaded its view, and the pool has its connections.
		for i, l := range ledgers {
			_, err := l.Do(ctx, req("orders", fmt.Sprintf("warm-%d", i)), noop)
			require.NoError(t, err)
		}
		var warm []*pgxpool.Conn
		for range 20 {
			c, err := b.pg.Pool.Acquire(ctx)
			require.NoError(t, err)
			warm = append(warm, c)
		}
		for _, c := range warm {
			c.Release()
		}
		opened := 0
		if mc.Layout != migrations.LayoutPlain {
			janitorLedger, err := inbox.New(b.pg.Pool, inbox.Config{})
			require.NoError(t, err)
			before := buckets(t, b)
			jctx, stop := context.WithCancel(ctx)
			janitor := make(chan struct{})
			go func() {
				defer close(janitor)
				for jctx.Err() == nil {
					if _, err := janitorLedger.Purge(jctx, inbox.JanitorConfig{}); err != nil && jctx.Err() == nil {
						t.Error(err)
					}
					time.Sleep(20 * time.Millisecond)
				}
			}()
			defer func() {
				stop()
				<-janitor
				require.Positive(t, opened, "buckets opened while the racers ran")
			}()
			defer func() { opened = buckets(t, b) - before }()
		}
		for k := 0; k < 8; k++ {
			id := fmt.Sprintf("evt-%d", k)
			shard := inbox.ShardOf(inbox.Key{Scope: "orders", ID: id}, migrations.DefaultShards)
			var ran atomic.Int64
			var inflight atomic.Int64
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := 0; i < 25; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					l := ledgers[i/4%2]
					// A key of the raced key's shard, new to this racer.
					filler := ""
					for n := 0; filler == ""; n++ {
						f := fmt.Sprintf("fill-%d-%d-%d", k, i, n)
						if inbox.ShardOf(inbox.Key{Scope: "orders", ID: f}, migrations.DefaultShards) == shard {
							filler = f
						}
					}
					<-start
					var d inbox.Disposition
					var err error
					switch i % 4 {
					case 0:
						var out inbox.Outcome
						out, err = l.Do(ctx, req("orders", id), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
							time.Sleep(20 * time.Millisecond)
							return pay(id, &ran)(ctx, tx)
						})
						d = out.Disposition
					case 1:
						var outs []inbox.Outcome
						outs, err = l.DoBatch(ctx, []inbox.Request{req("orders", id)}, func(ctx context.Context, tx pgx.Tx, _ []int) ([]inbox.Result, error) {
							time.Sleep(20 * time.Millisecond)
							_, err := pay(id, &ran)(ctx, tx)
							return nil, err
						})
						if err == nil {
							d = outs[0].Disposition
						}
					case 2:
						var run inbox.EachRun
						run, err = l.DoEach(ctx, []inbox.Request{req("orders", filler), req("orders", id)}, inbox.EachOptions{},
							func(ctx context.Context, tx pgx.Tx, j int) (inbox.Result, error) {
								if j == 0 {
									return inbox.Result{}, nil
								}
								time.Sleep(20 * time.Millisecond)
								return pay(id, &ran)(ctx, tx)
							})
						if err == nil && len(run.Outcomes) == 2 {
							d = run.Outcomes[1].Disposition
						}
					default:
						var out inbox.Outcome
						out, err = l.DoLeased(ctx, req("orders", id), time.Minute, func(context.Context, int64) (inbox.Result, error) {
							time.Sleep(20 * time.Millisecond)
							_, err := b.pg.Pool.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 1)`, id)
							ran.Add(1)
							return inbox.Result{}, err
						})
						d = out.Disposition
					}
					if err != nil {
						t.Error(err)
					}
					if d == inbox.InFlight {
						inflight.Add(1)
					}
				}()
			}
			close(start)
			wg.Wait()
			require.EqualValues(t, 1, ran.Load(), "key %s runs once", id)
			require.Positive(t, inflight.Load(), "the racers met the key in flight")
		}
		require.Equal(t, 8, b.pg.Count(t, `SELECT count(*) FROM payments`))
	})
}

func TestLayoutsExpiryLeaseReleaseFailure(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b := setupLayout(t, mc, inbox.Config{})
		ctx := context.Background()

		// Expiry: the key is new again, attempts start over.
		r := req("orders", "short")
		r.TTL = 300 * time.Millisecond
		var ran atomic.Int64
		_, err := b.ledger.Do(ctx, r, pay("p1", &ran))
		require.NoError(t, err)
		out, err := b.ledger.Do(ctx, r, pay("p1", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		testsvc.Eventually(t, 5*time.Second, func() bool {
			_, err := b.ledger.Lookup(ctx, r.Key)
			return errors.Is(err, inbox.ErrNotFound)
		}, "row expires")
		out, err = b.ledger.Do(ctx, r, pay("p2", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
		rec, err := b.ledger.Lookup(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, 1, rec.Attempts)
		require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'short'`), "one row per key")

		// Lease takeover with fencing.
		lr := req("payments", "charge-1")
		lr.Fingerprint = []byte("fp")
		l1, _, err := b.ledger.AcquireLease(ctx, lr, 300*time.Millisecond)
		require.NoError(t, err)
		require.NotNil(t, l1)
		_, o, err := b.ledger.AcquireLease(ctx, lr, time.Second)
		require.NoError(t, err)
		require.Equal(t, inbox.InFlight, o.Disposition)
		var l3 *inbox.Lease
		testsvc.Eventually(t, 5*time.Second, func() bool {
			l3, _, err = b.ledger.AcquireLease(ctx, lr, time.Second)
			require.NoError(t, err)
			return l3 != nil
		}, "lease taken over")
		require.Greater(t, l3.Token(), l1.Token())
		require.ErrorIs(t, l1.Complete(ctx, inbox.Result{Code: 200}), inbox.ErrLeaseLost)
		require.NoError(t, l3.Complete(ctx, inbox.Result{Code: 201, Body: []byte("charged")}))
		rec, err = b.ledger.Lookup(ctx, lr.Key)
		require.NoError(t, err)
		require.Equal(t, 2, rec.Attempts)
		require.Equal(t, inbox.StatusDone, rec.Status)

		// Release, then record failure; a done key stays done.
		ok, err := b.ledger.Release(ctx, lr.Key)
		require.NoError(t, err)
		require.True(t, ok)
		out, err = b.ledger.Do(ctx, lr, pay("p3", nil))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
		ok, err = b.ledger.RecordFailure(ctx, req("orders", "poison"), 5, errors.New("bad payload"))
		require.NoError(t, err)
		require.True(t, ok)
		out, err = b.ledger.Do(ctx, req("orders", "poison"), pay("x", nil))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.Equal(t, inbox.StatusFailed, out.Record.Status)
		require.Equal(t, 5, out.Record.Attempts)
		ok, err = b.ledger.RecordFailure(ctx, lr, 1, errors.New("late"))
		require.NoError(t, err)
		require.False(t, ok)
	})
}

func TestLayoutsJanitor(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		if mc.Layout != migrations.LayoutPlain { // buckets that go quickly
			mc.BucketWidth, mc.MaxTTL = time.Second, 2*time.Second
		}
		b := setupLayout(t, mc, inbox.Config{DefaultTTL: 2 * time.Second})
		ctx := context.Background()
		for i := 0; i < 20; i++ {
			r := req("j", fmt.Sprintf("old-%d", i))
			r.TTL = 100 * time.Millisecond
			_, err := b.ledger.Do(ctx, r, noop)
			require.NoError(t, err)
		}
		// Another instance holds the janitor lock: this one does nothing.
		tx, err := b.pg.Pool.Begin(ctx)
		require.NoError(t, err)
		lockSQL, lockKey := b.ledger.JanitorLockSQL()
		_, err = tx.Exec(ctx, lockSQL, lockKey)
		require.NoError(t, err)
		_, err = b.ledger.Purge(ctx, inbox.JanitorConfig{})
		require.ErrorIs(t, err, inbox.ErrJanitorBusy)
		require.NoError(t, tx.Rollback(ctx))

		// Keep claiming fresh keys while purging until the old rows are
		// gone: the new keys stay, every old key is new again.
		i := 0
		testsvc.Eventually(t, 15*time.Second, func() bool {
			i++
			_, err := b.ledger.Do(ctx, req("j", fmt.Sprintf("new-%d", i)), noop)
			require.NoError(t, err)
			_, err = b.ledger.Purge(ctx, inbox.JanitorConfig{})
			require.NoError(t, err)
			return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id LIKE 'old-%'`) == 0
		}, "old rows purged")
		out, err := b.ledger.Do(ctx, req("j", fmt.Sprintf("new-%d", i)), noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition, "the newest key survives the purge")
	})
}

// purgeWaitingForDetach starts a janitor pass and waits until it is
// detaching a bucket and held up (by a transaction still using the
// table), which the test names as holder; the pass's error comes on the
// channel once it finishes.
func purgeWaitingForDetach(ctx context.Context, t *testing.T, b *bundle, holder string) <-chan error {
	t.Helper()
	purged := make(chan error, 1)
	go func() {
		_, err := b.ledger.Purge(ctx, inbox.JanitorConfig{})
		purged <- err
	}()
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'processed_events'::regclass AND inhdetachpending`) == 1
	}, "detach pending")
	select {
	case err := <-purged:
		t.Fatalf("the janitor did not wait for %s: %v", holder, err)
	default:
	}
	return purged
}

// bucketsLedger is a time-bucket ledger with buckets of width and MaxTTL.
func bucketsLedger(t *testing.T, width, maxTTL time.Duration, opts ...testsvc.PGOption) *bundle {
	return setupLayout(t, migrations.Config{Layout: migrations.LayoutTimeBuckets, BucketWidth: width, MaxTTL: maxTTL},
		inbox.Config{DefaultTTL: maxTTL}, opts...)
}

func buckets(t *testing.T, b *bundle) int {
	return b.pg.Count(t, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'processed_events'::regclass`)
}

// openNext does what the janitor does when buckets are due, for every
// shard at once: opens each shard's next bucket, then, in a transaction of
// its own, closes the ones before.
func openNext(t *testing.T, b *bundle) {
	t.Helper()
	b.pg.Exec(t, `SELECT processed_events_open_bucket(s, now()) FROM generate_series(0, (SELECT shards FROM processed_events_layout) - 1) s`)
	b.pg.Exec(t, `UPDATE processed_events_buckets o SET closed_at = now()
		WHERE closed_at IS NULL AND EXISTS (SELECT 1 FROM processed_events_buckets n WHERE n.shard = o.shard AND n.id > o.id)`)
}

// bucketOf is the bucket that holds the row of key id.
func bucketOf(t *testing.T, b *bundle, id string) int {
	t.Helper()
	var bucket int
	require.NoError(t, b.pg.Pool.QueryRow(context.Background(), `SELECT bucket FROM processed_events WHERE event_id = $1`, id).Scan(&bucket))
	return bucket
}

// waitDue waits until bucket may go: closed, MaxTTL ago.
func waitDue(t *testing.T, b *bundle, bucket int) {
	t.Helper()
	testsvc.Eventually(t, 20*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events_buckets b, processed_events_layout l
			WHERE b.id = $1 AND b.closed_at + l.max_ttl <= now()`, bucket) == 1
	}, "bucket due")
}

func gone(t *testing.T, b *bundle, bucket int) bool {
	return b.pg.Count(t, `SELECT count(to_regclass($1))`, fmt.Sprintf("processed_events_b%d", bucket)) == 0
}

func TestBucketsTTLLongerThanABucket(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, 4*time.Second)
	ctx := context.Background()
	r := req("orders", "long")
	r.TTL = 3 * time.Second
	var ran atomic.Int64
	out, err := b.ledger.Do(ctx, r, pay("p1", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	claimed := time.Now()
	// The row outlives several buckets, the janitor running all along.
	for time.Since(claimed) < 2500*time.Millisecond {
		_, err := b.ledger.Purge(ctx, inbox.JanitorConfig{})
		require.NoError(t, err)
		out, err := b.ledger.Do(ctx, r, pay("p1", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition, "after %v", time.Since(claimed))
		time.Sleep(100 * time.Millisecond)
	}
	// Then it expires, and its bucket goes.
	testsvc.Eventually(t, 10*time.Second, func() bool {
		_, err := b.ledger.Purge(ctx, inbox.JanitorConfig{})
		require.NoError(t, err)
		return b.pg.Count(t, `SELECT count(*) FROM processed_events`) == 0
	}, "bucket dropped")
	out, err = b.ledger.Do(ctx, r, pay("p2", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.EqualValues(t, 2, ran.Load())
	// Buckets: per shard, the newest and those closed less than MaxTTL
	// ago, and one due that has not gone yet.
	require.LessOrEqual(t, buckets(t, b), migrations.DefaultShards*(4+1+1))

	// A TTL past MaxTTL is refused, not shortened, by every call that
	// would write a row with it.
	_, err = b.ledger.Do(ctx, req("orders", "too-long"), noop)
	require.NoError(t, err)
	tooLong := func(id string) inbox.Request {
		r := req("orders", id)
		r.TTL = 5 * time.Second
		return r
	}
	var pgErr *pgconn.PgError
	_, err = b.ledger.Do(ctx, tooLong("too-long-do"), pay("p3", &ran))
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "22023", pgErr.Code)
	require.EqualValues(t, 2, ran.Load(), "refused before the handler runs")
	_, err = b.ledger.DoBatch(ctx, []inbox.Request{req("orders", "fine"), tooLong("too-long-batch")},
		func(context.Context, pgx.Tx, []int) ([]inbox.Result, error) {
			ran.Add(1)
			return nil, nil
		})
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "22023", pgErr.Code)
	require.EqualValues(t, 2, ran.Load(), "refused before the handler runs")
	_, err = b.ledger.DoEach(ctx, []inbox.Request{req("orders", "fine"), tooLong("too-long-each")}, inbox.EachOptions{},
		func(context.Context, pgx.Tx, int) (inbox.Result, error) {
			ran.Add(1)
			return inbox.Result{}, nil
		})
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "22023", pgErr.Code)
	require.EqualValues(t, 2, ran.Load(), "refused before any handler runs, the first request's too")
	_, _, err = b.ledger.AcquireLease(ctx, tooLong("too-long-lease"), time.Second)
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "22023", pgErr.Code)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id LIKE 'too-long-%' OR event_id = 'fine'`))
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'p3'`))
}

func batchNoop(context.Context, pgx.Tx, []int) ([]inbox.Result, error) { return nil, nil }

// A claim racing a bucket's drop: the claim's transaction is open (it took
// over a key whose expired row sits in the bucket to drop) while the
// janitor detaches that bucket. The janitor waits for it; other claims,
// including one of a key in the same bucket, go on; after the commit the
// taken-over key lives in the newest bucket of its shard.
func TestBucketsClaimRacesADrop(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, 3*time.Second)
	ctx := context.Background()
	require.NoError(t, b.ledger.DropAtOnce(ctx))
	short := func(id string) inbox.Request {
		r := req("orders", id)
		r.TTL = 500 * time.Millisecond
		return r
	}
	var ran atomic.Int64
	for _, id := range []string{"held", "other"} {
		out, err := b.ledger.Do(ctx, short(id), pay(id+"-1", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
	}
	oldBucket := bucketOf(t, b, "held")
	// The key's shard moves on; wait until the bucket is due to go.
	openNext(t, b)
	waitDue(t, b, oldBucket)

	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	held := short("held")
	held.TTL = 3 * time.Second // outlives the wait below
	out, err := b.ledger.DoTx(ctx, tx, held, pay("held-2", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)

	// The janitor is waiting for the open transaction, with the bucket
	// marked for detaching.
	purged := purgeWaitingForDetach(ctx, t, b, "the open claim")
	// Claims are not blocked meanwhile: a new key, and the other key of
	// the bucket being dropped (expired: new again), and the held key (in
	// flight).
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	out, err = b.ledger.Do(cctx, req("orders", "fresh"), pay("fresh", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	out, err = b.ledger.Do(cctx, short("other"), pay("other-2", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	out, err = b.ledger.Do(cctx, short("held"), pay("held-3", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.InFlight, out.Disposition)

	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-purged)
	require.True(t, gone(t, b, oldBucket), "bucket dropped")
	out, err = b.ledger.Do(ctx, short("held"), pay("held-4", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition, "the taken-over key outlives its old bucket")
	require.EqualValues(t, 5, ran.Load())
}

// A janitor cancelled while it waits leaves the bucket half detached; the
// next pass finishes the job.
func TestBucketsCancelledDropIsFinishedLater(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, time.Second)
	ctx := context.Background()
	require.NoError(t, b.ledger.DropAtOnce(ctx))
	r := req("orders", "x")
	r.TTL = 500 * time.Millisecond
	_, err := b.ledger.Do(ctx, r, noop)
	require.NoError(t, err)
	oldBucket := bucketOf(t, b, "x")
	openNext(t, b)
	waitDue(t, b, oldBucket)

	// Any open transaction on the table holds the detach.
	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT count(*) FROM processed_events`)
	require.NoError(t, err)
	pctx, cancel := context.WithCancel(ctx)
	purged := make(chan error, 1)
	go func() {
		_, err := b.ledger.Purge(pctx, inbox.JanitorConfig{})
		purged <- err
	}()
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'processed_events'::regclass AND inhdetachpending`) == 1
	}, "detach pending")
	cancel()
	require.Error(t, <-purged)
	require.NoError(t, tx.Rollback(ctx))

	// Finishing the detach waits for every older snapshot in the
	// database (other tests' transactions too): bounded, not immediate.
	fctx, fcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer fcancel()
	_, err = b.ledger.Purge(fctx, inbox.JanitorConfig{})
	require.NoError(t, err)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'processed_events'::regclass AND inhdetachpending`))
	require.True(t, gone(t, b, oldBucket))
}

// An existing plain ledger moves to time buckets with its live rows.
func TestBucketsConvertAPlainLedger(t *testing.T) {
	t.Parallel()
	b := setupLayout(t, migrations.Config{}, inbox.Config{})
	ctx := context.Background()
	var ran atomic.Int64
	for i := 0; i < 50; i++ {
		_, err := b.ledger.Do(ctx, req("orders", fmt.Sprintf("live-%d", i)), pay(fmt.Sprintf("p%d", i), &ran))
		require.NoError(t, err)
	}
	gone := req("orders", "expired")
	gone.TTL = time.Millisecond
	_, err := b.ledger.Do(ctx, gone, noop)
	require.NoError(t, err)
	testsvc.Eventually(t, 5*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE expires_at <= now()`) == 1
	}, "row expires")
	lease, _, err := b.ledger.AcquireLease(ctx, req("orders", "leased"), time.Minute)
	require.NoError(t, err)

	_, err = migrations.New(b.pg.Pool, migrations.Config{Schema: b.pg.Schema, Layout: migrations.LayoutTimeBuckets}).Up(ctx)
	require.NoError(t, err)
	require.Equal(t, 51, b.pg.Count(t, `SELECT count(*) FROM processed_events`), "live rows copied, expired ones not")

	l, err := inbox.New(b.pg.Pool, inbox.Config{}) // a ledger started after the move
	require.NoError(t, err)
	for i := 0; i < 50; i++ {
		out, err := l.Do(ctx, req("orders", fmt.Sprintf("live-%d", i)), pay("again", &ran))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.Equal(t, 201, out.Result.Code)
	}
	out, err := l.Do(ctx, gone, noop)
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.NoError(t, lease.Complete(ctx, inbox.Result{Code: 200}), "a lease taken before the move completes after it")

	// Up again keeps the layout; Down and Up give a plain table back.
	m := migrations.New(b.pg.Pool, migrations.Config{Schema: b.pg.Schema})
	_, err = m.Up(ctx)
	require.NoError(t, err)
	require.Positive(t, buckets(t, b))
	_, err = m.Down(ctx)
	require.NoError(t, err)
	_, err = m.Up(ctx)
	require.NoError(t, err)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM pg_proc WHERE proname LIKE 'processed_events_%' AND pronamespace = $1::regnamespace`, b.pg.Schema))
}

// Do and DoBatch on a session whose transactions default to REPEATABLE
// READ: the look-up's snapshot would predate the key's lock, so the claim
// refuses before anything runs.
func TestBucketsRefuseRepeatableReadByDefault(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, 2*time.Second, testsvc.MaxConns(1))
	ctx := context.Background()
	_, err := b.pg.Pool.Exec(ctx, `SET SESSION default_transaction_isolation = 'repeatable read'`)
	require.NoError(t, err)
	var ran atomic.Int64
	var pgErr *pgconn.PgError
	_, err = b.ledger.Do(ctx, req("orders", "rr"), pay("p1", &ran))
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "0A000", pgErr.Code)
	_, err = b.ledger.DoBatch(ctx, []inbox.Request{req("orders", "rr1"), req("orders", "rr2")}, batchNoop)
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "0A000", pgErr.Code)
	require.Zero(t, ran.Load())

	_, err = b.pg.Pool.Exec(ctx, `SET SESSION default_transaction_isolation = 'read committed'`)
	require.NoError(t, err)
	out, err := b.ledger.Do(ctx, req("orders", "rr"), pay("p1", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
}

// The bucket check relies on READ COMMITTED's fresh snapshot per
// statement; in a stricter transaction the claim refuses.
func TestBucketsRefuseRepeatableRead(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, 2*time.Second)
	ctx := context.Background()
	tx, err := b.pg.Pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = b.ledger.DoTx(ctx, tx, req("orders", "rr"), noop)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "0A000", pgErr.Code)
}

// Do and DoBatch on the time-bucket layout write each row once, complete,
// into the newest bucket of its shard; a key is found in any bucket whatever the TTL
// of the call that asks; an expired row in an older bucket is taken over
// by moving it, so a key never has two rows.
func TestBucketsWriteOnce(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, 4*time.Second)
	ctx := context.Background()
	var ran atomic.Int64
	out, err := b.ledger.Do(ctx, req("orders", "once"), pay("p1", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	outs, err := b.ledger.DoBatch(ctx, []inbox.Request{req("orders", "b1"), req("orders", "b2")},
		func(ctx context.Context, tx pgx.Tx, idx []int) ([]inbox.Result, error) {
			return []inbox.Result{{Code: 201}, {Code: 202}}, nil
		})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, outs[0].Disposition)
	require.Equal(t, inbox.Executed, outs[1].Disposition)
	// Never updated (xmax 0: no second version, no row lock), in the
	// newest bucket of the key's shard, complete.
	require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM processed_events
		WHERE xmax = '0' AND status = 'done' AND response_code IS NOT NULL AND completed_at IS NOT NULL
			AND bucket = (SELECT max(id) FROM processed_events_buckets WHERE shard = processed_events_shard(scope, tenant, event_id))
			AND bucket % 8 = processed_events_shard(scope, tenant, event_id)
			AND expires_at = created_at + interval '4 seconds'`))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'once' AND ctid = '(0,1)'`))

	// A shorter TTL asks later, from a later bucket: the row is found.
	short := req("orders", "once")
	short.TTL = 200 * time.Millisecond
	openNext(t, b)
	out, err = b.ledger.Do(ctx, short, pay("p2", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.Equal(t, 201, out.Result.Code)
	shortB := req("orders", "b2")
	shortB.TTL = 200 * time.Millisecond
	outs, err = b.ledger.DoBatch(ctx, []inbox.Request{shortB}, batchNoop)
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, outs[0].Disposition)
	require.EqualValues(t, 1, ran.Load())

	// Expired, in an older bucket: taken over, moved, one row.
	oldBucket := bucketOf(t, b, "once")
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'once' AND expires_at <= now()`) == 1
	}, "row expires")
	out, err = b.ledger.Do(ctx, short, pay("p3", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'once'`))
	require.Greater(t, bucketOf(t, b, "once"), oldBucket, "moved")
	require.EqualValues(t, 2, ran.Load())
}

// A Do whose handler is still running when the janitor drops the bucket
// that held the key's expired row (which the Do took over): the janitor
// waits for it, and the key ends in the newest bucket of its shard, once.
func TestBucketsDoRacesADrop(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, 2*time.Second)
	ctx := context.Background()
	require.NoError(t, b.ledger.DropAtOnce(ctx))
	short := req("orders", "held")
	short.TTL = 300 * time.Millisecond
	var ran atomic.Int64
	_, err := b.ledger.Do(ctx, short, pay("held-1", &ran))
	require.NoError(t, err)
	oldBucket := bucketOf(t, b, "held")
	openNext(t, b)
	waitDue(t, b, oldBucket)

	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		out, err := b.ledger.Do(ctx, short, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			close(entered)
			<-release
			return pay("held-2", &ran)(ctx, tx)
		})
		if err == nil && out.Disposition != inbox.Executed {
			err = fmt.Errorf("disposition %v", out.Disposition)
		}
		done <- err
	}()
	<-entered
	purged := purgeWaitingForDetach(ctx, t, b, "the running Do")
	out, err := b.ledger.Do(ctx, short, pay("held-3", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.InFlight, out.Disposition)
	close(release)
	require.NoError(t, <-done)
	require.NoError(t, <-purged)
	require.Greater(t, bucketOf(t, b, "held"), oldBucket)
	require.True(t, gone(t, b, oldBucket))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'held'`))
	require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id LIKE 'held-%'`))
}

// A row written for the key without its lock, in the bucket the claim
// writes to (an operator's INSERT): the claim's INSERT meets it, the
// transaction and the handler's effect roll back, and the claim made again
// finds the row, as on the plain table. (In another bucket nothing would
// meet it: on this layout the key's lock alone keeps a key to one row.)
func TestBucketsRowWrittenWithoutTheLock(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Minute, 2*time.Minute)
	ctx := context.Background()
	runs := 0
	out, err := b.ledger.Do(ctx, req("orders", "sneak"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		runs++
		if runs == 1 {
			var bucket int
			require.NoError(t, tx.QueryRow(ctx, `SELECT max(id) FROM processed_events_buckets
				WHERE shard = processed_events_shard('orders', '', 'sneak')`).Scan(&bucket))
			_, err := b.pg.Pool.Exec(ctx, `INSERT INTO processed_events (scope, tenant, event_id, status, source, expires_at, bucket)
				VALUES ('orders', '', 'sneak', 'failed', 'other', now() + interval '1 minute', $1)`, bucket)
			require.NoError(t, err)
		}
		return pay("p-sneak", nil)(ctx, tx)
	})
	require.NoError(t, err)
	require.Equal(t, 1, runs, "the second claim finds the row and does not run the handler")
	require.Equal(t, inbox.Duplicate, out.Disposition)
	require.Equal(t, inbox.StatusFailed, out.Record.Status)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM payments`), "the handler's effect rolled back")
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'sneak'`))
}

// DoBatch takes over expired rows in older buckets by moving them, next to
// new keys written with the commit.
func TestBucketsBatchTakesOverAcrossBuckets(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, 3*time.Second)
	ctx := context.Background()
	short := func(id string) inbox.Request {
		r := req("orders", id)
		r.TTL = 200 * time.Millisecond
		return r
	}
	_, err := b.ledger.DoBatch(ctx, []inbox.Request{short("old-1"), short("old-2")}, batchNoop)
	require.NoError(t, err)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE expires_at <= now()`) == 2
	}, "rows expire")
	openNext(t, b)
	var ran atomic.Int64
	outs, err := b.ledger.DoBatch(ctx, []inbox.Request{short("old-1"), short("new"), short("old-2")},
		func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
			ran.Add(int64(len(fresh)))
			return nil, nil
		})
	require.NoError(t, err)
	for i, o := range outs {
		require.Equal(t, inbox.Executed, o.Disposition, i)
	}
	require.EqualValues(t, 3, ran.Load())
	require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM processed_events`), "one row per key")
	require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM processed_events
		WHERE bucket IN (SELECT max(id) FROM processed_events_buckets GROUP BY shard)`), "all in their shard's newest bucket")
}

// The shard the ledger computes in Go is the one processed_events_shard
// computes in SQL (a migration uses it to place the rows it copies).
func TestBucketsShardInGoMatchesSQL(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Hour, time.Hour)
	ctx := context.Background()
	keys := []inbox.Key{{Scope: "", ID: ""}, {Scope: "orders", ID: "evt-1"}, {Scope: "orders", Tenant: "acme", ID: "evt-1"},
		{Scope: "ordersa", Tenant: "cme", ID: "evt-1"}, {Scope: "http", ID: "κλειδί-🔑"}, {Scope: strings.Repeat("s", 300), ID: strings.Repeat("x", 1000)}}
	for i := 0; i < 200; i++ {
		keys = append(keys, inbox.Key{Scope: "s" + strconv.Itoa(i%7), Tenant: strconv.Itoa(i % 3), ID: "id-" + strconv.Itoa(i)})
	}
	seen := map[int]bool{}
	for _, k := range keys {
		var sql int
		require.NoError(t, b.pg.Pool.QueryRow(ctx, `SELECT processed_events_shard($1, $2, $3)`, k.Scope, k.Tenant, k.ID).Scan(&sql))
		require.Equal(t, sql, inbox.ShardOf(k, migrations.DefaultShards), "%+v", k)
		seen[sql] = true
	}
	require.Len(t, seen, migrations.DefaultShards, "keys spread over every shard")
}

// A ledger whose view of the buckets is stale never runs a key twice: a
// bucket opened since its view was loaded makes the claim look again (the
// key's row may be in that bucket), a bucket opened while the handler ran
// refuses the row (the transaction rolls back and the claim is made
// again), and a bucket dropped since is pruned from the look-up (no
// partition has its id), so claims go on.
func TestBucketsStaleViewNeverDoubles(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Hour, 2*time.Second)
	ctx := context.Background()
	other, err := inbox.New(b.pg.Pool, inbox.Config{DefaultTTL: 2 * time.Second}) // another process
	require.NoError(t, err)
	require.NoError(t, other.DropAtOnce(ctx))
	var ran atomic.Int64
	_, err = b.ledger.Do(ctx, req("orders", "first"), pay("first", &ran)) // loads the view
	require.NoError(t, err)

	// Opened since the view: the other process writes the key into the
	// new bucket; this one finds it there.
	openNext(t, b)
	out, err := other.Do(ctx, req("orders", "k"), pay("k", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Greater(t, bucketOf(t, b, "k"), bucketOf(t, b, "first")%migrations.DefaultShards, "in a new bucket")
	calls := 0
	out, err = b.ledger.Do(ctx, req("orders", "k"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		calls++
		return pay("k-again", &ran)(ctx, tx)
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	// The bucket opened ahead of the janitor's schedule, so the claim's
	// first statement did not look for it: the handler may have run, but
	// its row was refused and its effect rolled back.
	require.LessOrEqual(t, calls, 1)
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'k-again'`))

	// Opened while the handler ran: the row is refused, the handler's
	// effect rolls back, and the claim made again writes the key once,
	// into the newest bucket.
	runs := 0
	out, err = b.ledger.Do(ctx, req("orders", "during"), func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		runs++
		if runs == 1 {
			openNext(t, b)
		}
		return pay("during", &ran)(ctx, tx)
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Equal(t, 2, runs, "the handler ran again after the refused row")
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id = 'during'`))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'during'
		AND bucket = (SELECT max(id) FROM processed_events_buckets WHERE shard = processed_events_shard(scope, tenant, event_id))`))

	// Dropped since the view: the other process's janitor drops the
	// oldest buckets (closed, MaxTTL ago); this ledger's view still names
	// them, and its claims of every shard go on.
	_, err = b.ledger.Do(ctx, req("orders", "view"), noop) // a view with three buckets per shard
	require.NoError(t, err)
	first := bucketOf(t, b, "first") % migrations.DefaultShards // the shard's first bucket id
	waitDue(t, b, first)
	_, err = other.Purge(ctx, inbox.JanitorConfig{})
	require.NoError(t, err)
	require.True(t, gone(t, b, first), "the shard's first bucket dropped")
	for i := 0; i < 2*migrations.DefaultShards; i++ { // keys of every shard
		out, err = b.ledger.Do(ctx, req("orders", fmt.Sprintf("after-%d", i)), noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
	}
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id LIKE 'k%'`), "k ran once")
}

// The janitor opens each shard's next bucket a width after the last one,
// one shard at a time; while it does not run, claims go on in the newest
// buckets (the table grows, nothing fails).
func TestBucketsJanitorSchedule(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Second, time.Second)
	ctx := context.Background()
	// No janitor for three widths: claims go on.
	deadline := time.Now().Add(3 * time.Second)
	for i := 0; time.Now().Before(deadline); i++ {
		out, err := b.ledger.Do(ctx, req("orders", fmt.Sprintf("k-%d", i)), noop)
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
		time.Sleep(20 * time.Millisecond)
	}
	require.Equal(t, migrations.DefaultShards, buckets(t, b), "no bucket opened without the janitor")
	// The janitor catches up: one new bucket per shard, scheduled whole
	// widths after the last (so still staggered), the old ones closed.
	_, err := b.ledger.Purge(ctx, inbox.JanitorConfig{})
	require.NoError(t, err)
	require.Equal(t, 2*migrations.DefaultShards, buckets(t, b))
	var frac []float64
	require.NoError(t, b.pg.Pool.QueryRow(ctx, `SELECT array_agg(extract(epoch FROM opened_at)::numeric % 1 ORDER BY shard)
		FROM processed_events_buckets WHERE closed_at IS NULL`).Scan(&frac))
	var first float64
	require.NoError(t, b.pg.Pool.QueryRow(ctx, `SELECT extract(epoch FROM opened_at)::numeric % 1
		FROM processed_events_buckets WHERE id = 0`).Scan(&first))
	for s, f := range frac {
		want := math.Mod(first-float64(s)/float64(migrations.DefaultShards)+1, 1)
		require.InDelta(t, want, f, 0.002, "shard %d opens 1/%d width after shard %d", s, migrations.DefaultShards, s-1)
	}
	require.Equal(t, migrations.DefaultShards, b.pg.Count(t, `SELECT count(*) FROM processed_events_buckets WHERE closed_at IS NOT NULL`))
	// MaxTTL after closing, the first buckets are detached with their
	// rows: they leave the bucket list at once, and their tables go once
	// no claim's view can name them any more (a second or so later).
	testsvc.Eventually(t, 15*time.Second, func() bool {
		_, err := b.ledger.Purge(ctx, inbox.JanitorConfig{})
		require.NoError(t, err)
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id LIKE 'k-%'`) == 0
	}, "old buckets detached")
	require.Positive(t, b.pg.Count(t, `SELECT count(*) FROM processed_events_buckets WHERE detached_at IS NOT NULL`))
	out, err := b.ledger.Do(ctx, req("orders", "k-0"), noop) // its view no longer names them
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition, "k-0 expired")
	testsvc.Eventually(t, 15*time.Second, func() bool {
		_, err := b.ledger.Purge(ctx, inbox.JanitorConfig{})
		require.NoError(t, err)
		return b.pg.Count(t, `SELECT count(*) FROM processed_events_buckets WHERE id < $1`, migrations.DefaultShards) == 0
	}, "the first buckets' tables dropped")
	for id := 0; id < migrations.DefaultShards; id++ {
		require.True(t, gone(t, b, id))
	}
}

// DoEach (the batched consumers' claim) on the time-bucket layout: keys
// new, done, expired (taken over), and done in a bucket opened since the
// ledger's view was loaded, in one run; each runs once.
func TestBucketsDoEach(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Hour, 2*time.Second)
	ctx := context.Background()
	other, err := inbox.New(b.pg.Pool, inbox.Config{DefaultTTL: 2 * time.Second}) // another process
	require.NoError(t, err)
	short := req("orders", "short")
	short.TTL = 100 * time.Millisecond
	for _, r := range []inbox.Request{req("orders", "done"), short} {
		_, err := b.ledger.Do(ctx, r, noop) // also loads the view
		require.NoError(t, err)
	}
	openNext(t, b)
	_, err = other.Do(ctx, req("orders", "elsewhere"), noop) // in a bucket the view does not know
	require.NoError(t, err)
	testsvc.Eventually(t, 5*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'short' AND expires_at <= now()`) == 1
	}, "row expires")

	reqs := []inbox.Request{req("orders", "new-1"), req("orders", "done"), short, req("orders", "elsewhere"), req("orders", "new-2")}
	var ran []int
	run, err := b.ledger.DoEach(ctx, reqs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		ran = append(ran, i)
		_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, reqs[i].ID)
		return inbox.Result{Code: 200 + i}, err
	})
	require.NoError(t, err)
	require.NoError(t, run.Failed)
	require.Equal(t, []int{0, 2, 4}, ran)
	var got []inbox.Disposition
	for _, o := range run.Outcomes {
		got = append(got, o.Disposition)
	}
	require.Equal(t, []inbox.Disposition{inbox.Executed, inbox.Duplicate, inbox.Executed, inbox.Duplicate, inbox.Executed}, got)
	// One row per key, each in its shard's newest bucket, with its result.
	require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id IN ('new-1', 'short', 'new-2')
		AND bucket = (SELECT max(id) FROM processed_events_buckets WHERE shard = processed_events_shard(scope, tenant, event_id))
		AND response_code IS NOT NULL`))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'short'`))
	require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM payments`))
}

// A bucket opened while a DoEach run is under way, after the run has
// written into the shard's newest bucket (so its transaction holds every
// lock its later claims need): another process claims a later key of the
// run in the new bucket and commits; when the run reaches that key it
// finds it there, and its handler does not run.
func TestBucketsDoEachBucketOpensMidRun(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Hour, 2*time.Second)
	ctx := context.Background()
	// Three keys of one shard.
	var ids []string
	for i := 0; len(ids) < 3; i++ {
		id := "mid-" + strconv.Itoa(i)
		if inbox.ShardOf(inbox.Key{Scope: "orders", ID: id}, migrations.DefaultShards) == 0 {
			ids = append(ids, id)
		}
	}
	_, err := b.ledger.Do(ctx, req("orders", ids[0]+"-warm"), noop) // loads the view
	require.NoError(t, err)
	other, err := inbox.New(b.pg.Pool, inbox.Config{DefaultTTL: 2 * time.Second}) // another process
	require.NoError(t, err)
	reqs := []inbox.Request{req("orders", ids[0]), req("orders", ids[1]), req("orders", ids[2])}
	ran := map[string]int{}
	run, err := b.ledger.DoEach(ctx, reqs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		ran[reqs[i].ID]++
		if _, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, reqs[i].ID+"-each"); err != nil {
			return inbox.Result{}, err
		}
		if i == 0 {
			// After the run's first row and first handler: the next
			// bucket opens, and another process claims the second key in it.
			openNext(t, b)
			out, err := other.Do(ctx, reqs[1], func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				ran[reqs[1].ID]++
				_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, reqs[1].ID+"-other")
				return inbox.Result{}, err
			})
			require.NoError(t, err)
			require.Equal(t, inbox.Executed, out.Disposition)
		}
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
	require.NoError(t, run.Failed)
	require.Len(t, run.Outcomes, 3)
	require.Equal(t, inbox.Duplicate, run.Outcomes[1].Disposition, "the key claimed elsewhere meanwhile")
	require.Equal(t, 1, ran[ids[1]], "the second key's handler ran once, in the other process")
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = $1`, ids[1]))
	require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM payments WHERE id LIKE $1`, ids[1]+"-%"))
}

// A bucket view loaded inside a DoEach run carries the database's time of
// loading, not the start of the run's transaction: Do tells from it
// whether the shard's next bucket may have opened since, and an old time
// would let it skip that check.
func TestBucketsViewLoadedInARunKeepsItsTime(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Hour, 2*time.Second)
	ctx := context.Background()
	_, err := b.ledger.Do(ctx, req("orders", "warm"), noop)
	require.NoError(t, err)
	before := b.ledger.ViewDBTime() // every claim from now on loads the view again
	require.False(t, before.IsZero())
	const pause = 300 * time.Millisecond
	run, err := b.ledger.DoEach(ctx, []inbox.Request{req("orders", "run-1"), req("orders", "run-2")}, inbox.EachOptions{},
		func(_ context.Context, _ pgx.Tx, i int) (inbox.Result, error) {
			if i == 0 {
				time.Sleep(pause) // the run's transaction ages before the second claim loads the view
			}
			return inbox.Result{}, nil
		})
	require.NoError(t, err)
	require.Len(t, run.Outcomes, 2)
	require.GreaterOrEqual(t, b.ledger.ViewDBTime().Sub(before), pause)
}

// sameShard returns n key IDs (prefix and a number) of shard 0.
func sameShard(prefix string, n int) []string {
	var ids []string
	for i := 0; len(ids) < n; i++ {
		id := prefix + strconv.Itoa(i)
		if inbox.ShardOf(inbox.Key{Scope: "orders", ID: id}, migrations.DefaultShards) == 0 {
			ids = append(ids, id)
		}
	}
	return ids
}

// A caller's transaction claims with DoTx, then the shard's next bucket
// opens and another process writes a key there: the same transaction's
// next DoTx calls find that key, and write a new one into the new bucket.
// Postgres keeps the transaction's list of partitions from before the
// opening, since the transaction already holds the ledger's locks; the
// claim brings it up to date instead of failing the caller's transaction
// with "no partition found for row".
func TestBucketsDoTxAcrossABucketOpening(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Hour, 2*time.Second)
	ctx := context.Background()
	ids := sameShard("tx-", 3)
	other, err := inbox.New(b.pg.Pool, inbox.Config{DefaultTTL: 2 * time.Second}) // another process
	require.NoError(t, err)
	var ran atomic.Int64
	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	out, err := b.ledger.DoTx(ctx, tx, req("orders", ids[0]), pay(ids[0], &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	openNext(t, b)
	out, err = other.Do(ctx, req("orders", ids[1]), pay(ids[1], &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)

	out, err = b.ledger.DoTx(ctx, tx, req("orders", ids[1]), pay(ids[1]+"-again", &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Duplicate, out.Disposition)
	out, err = b.ledger.DoTx(ctx, tx, req("orders", ids[2]), pay(ids[2], &ran))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.NoError(t, tx.Commit(ctx))
	require.EqualValues(t, 3, ran.Load())
	require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM payments`))
	require.Greater(t, bucketOf(t, b, ids[2]), bucketOf(t, b, ids[0]), "the new key went into the new bucket")
}

// A DoEach run takes over two expired keys of one shard, the shard's next
// bucket opening while the first one's handler runs: the second is moved
// into the new bucket, and the run does not fail (see
// TestBucketsDoTxAcrossABucketOpening).
func TestBucketsDoEachTakeoversAcrossABucketOpening(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Hour, 3*time.Second)
	ctx := context.Background()
	ids := sameShard("take-", 2)
	var reqs []inbox.Request
	for _, id := range ids {
		r := req("orders", id)
		r.TTL = 100 * time.Millisecond
		_, err := b.ledger.Do(ctx, r, noop)
		require.NoError(t, err)
		reqs = append(reqs, req("orders", id))
	}
	testsvc.Eventually(t, 5*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE expires_at <= now()`) == 2
	}, "rows expire")
	var ran []int
	run, err := b.ledger.DoEach(ctx, reqs, inbox.EachOptions{}, func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		ran = append(ran, i)
		_, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, 1)`, reqs[i].ID)
		if i == 0 {
			// After the run's first statement on every table it uses.
			openNext(t, b)
		}
		return inbox.Result{}, err
	})
	require.NoError(t, err)
	require.NoError(t, run.Failed)
	require.Equal(t, []int{0, 1}, ran)
	require.Len(t, run.Outcomes, 2)
	for _, o := range run.Outcomes {
		require.Equal(t, inbox.Executed, o.Disposition)
	}
	require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM payments`))
	require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM processed_events`), "one row per key")
	require.Greater(t, bucketOf(t, b, ids[1]), bucketOf(t, b, ids[0]), "the second key moved into the new bucket")
}

// A release waiting for a row that a takeover moves to a newer bucket is
// answered on the row where it went (Postgres refuses the first delete
// with a serialization failure): here the takeover's lease runs, so the
// key is not stuck.
func TestBucketsReleaseRacesATakeover(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Minute, time.Minute)
	ctx := context.Background()
	r := req("orders", "stuck")
	lease, _, err := b.ledger.AcquireLease(ctx, r, 50*time.Millisecond)
	require.NoError(t, err)
	require.NotNil(t, lease)
	old := bucketOf(t, b, "stuck")
	openNext(t, b)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = 'stuck' AND lease_until <= now()`) == 1
	}, "the lease ran out")

	// A takeover, as the claim makes one: the row moves to the shard's
	// newest bucket, under a new lease.
	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = tx.Exec(ctx, `UPDATE processed_events SET lease_until = now() + interval '1 hour', fencing_token = fencing_token + 1,
		bucket = (SELECT max(n.id) FROM processed_events_buckets n, processed_events_buckets o WHERE o.id = $1 AND n.shard = o.shard)
		WHERE event_id = 'stuck'`, old)
	require.NoError(t, err)
	var xid string
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&xid))

	released := make(chan error, 1)
	go func() {
		_, err := b.ledger.ReleaseStuck(ctx, r.Key)
		released <- err
	}()
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid' AND transactionid::text = $1`, xid) > 0
	}, "the release waits for the takeover")
	require.NoError(t, tx.Commit(ctx))
	require.NotEqual(t, old, bucketOf(t, b, "stuck"), "the row moved")
	select {
	case err := <-released:
		require.ErrorIs(t, err, inbox.ErrNotStuck)
	case <-time.After(30 * time.Second):
		t.Fatal("the release did not return")
	}
	require.ErrorIs(t, lease.Complete(ctx, inbox.Result{}), inbox.ErrLeaseLost)
}

// A key whose lease holder went away (its lease lapsed, its row still
// processing) is taken over by Do and by DoEach, and only once the lease has
// lapsed: before that they answer InFlight.
func TestLayoutsDoTakesOverALapsedLease(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b := setupLayout(t, mc, inbox.Config{})
		ctx := context.Background()
		for _, each := range []bool{false, true} {
			r := req("payments", fmt.Sprintf("lapsed-%v", each))
			held, _, err := b.ledger.AcquireLease(ctx, r, 2*time.Second)
			require.NoError(t, err)
			require.NotNil(t, held)
			var ran atomic.Int64
			do := func() inbox.Outcome {
				if !each {
					out, err := b.ledger.Do(ctx, r, pay("p-"+r.ID, &ran))
					require.NoError(t, err)
					return out
				}
				run, err := b.ledger.DoEach(ctx, []inbox.Request{r}, inbox.EachOptions{},
					func(ctx context.Context, tx pgx.Tx, _ int) (inbox.Result, error) {
						return pay("p-"+r.ID, &ran)(ctx, tx)
					})
				require.NoError(t, err)
				require.Len(t, run.Outcomes, 1)
				return run.Outcomes[0]
			}
			require.Equal(t, inbox.InFlight, do().Disposition, "the lease runs")
			require.Zero(t, ran.Load())
			testsvc.Eventually(t, 10*time.Second, func() bool {
				return b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE event_id = $1 AND lease_until < now()`, r.ID) == 1
			}, "the lease lapses")
			require.Equal(t, inbox.Executed, do().Disposition, "the lapsed lease is taken over")
			require.Equal(t, int64(1), ran.Load())
			require.ErrorIs(t, held.Complete(ctx, inbox.Result{Code: 200}), inbox.ErrLeaseLost)
			require.Equal(t, inbox.Duplicate, do().Disposition)
		}
	})
}
