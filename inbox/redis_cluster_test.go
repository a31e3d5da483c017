package inbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// clusterLedger is a ledger in front of a Redis Cluster of three masters of
// the test's own, with an effects table that does not refuse doubles (so a
// doubled effect is counted, not hidden behind a unique violation).
func clusterLedger(t *testing.T, rc *testsvc.RedisCluster, timeout time.Duration) *bundle {
	t.Helper()
	b := setup(t, inbox.Config{Redis: &inbox.RedisConfig{Client: rc.Client(t), Timeout: timeout}}, testsvc.MaxConns(8))
	b.pg.Exec(t, `CREATE TABLE effects (id text NOT NULL)`)
	return b
}

// effect is a handler with one business write and an in-memory count.
func effect(id string, runs *sync.Map) inbox.TxFunc {
	return func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		n, _ := runs.LoadOrStore(id, new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		_, err := tx.Exec(ctx, `INSERT INTO effects (id) VALUES ($1)`, id)
		return inbox.Result{Code: 200, Body: []byte(id)}, err
	}
}

// requireExactlyOnce: every key has exactly one effect row and a done
// ledger row, and nothing else is there.
func requireExactlyOnce(t *testing.T, b *bundle, scope string, keys int) {
	t.Helper()
	require.Equal(t, 0, b.pg.Count(t, `SELECT count(*) FROM (SELECT id FROM effects GROUP BY id HAVING count(*) > 1) d`), "0 doubled")
	require.Equal(t, keys, b.pg.Count(t, `SELECT count(DISTINCT id) FROM effects`), "0 lost")
	require.Equal(t, keys, b.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, keys, b.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = $1 AND status = 'done'`, scope))
	require.Equal(t, keys, b.pg.Count(t, `SELECT count(*) FROM processed_events`))
}

// doUntilAnswered calls Do until the key is answered Executed or Duplicate
// (an InFlight answer is a redelivery to try again), bounded by count and
// deadline.
func doUntilAnswered(ctx context.Context, l *inbox.Ledger, r inbox.Request, fn inbox.TxFunc) (inbox.Outcome, error) {
	deadline := time.Now().Add(30 * time.Second)
	for try := 0; try < 20000; try++ {
		out, err := l.Do(ctx, r, fn)
		if err != nil || out.Disposition != inbox.InFlight {
			return out, err
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond) // a client retrying an in-flight key
	}
	return inbox.Outcome{}, fmt.Errorf("key %s still in flight after 30s", r.Key.ID)
}

// TestRedisClusterSpreadsKeysAndRunsOnce: on a real three-master Redis
// Cluster, keys spread over every master (a key's lock and cached result
// share one slot), four concurrent deliveries of each of 240 keys run its
// handler once, and duplicates afterwards are answered from the cluster
// without Postgres.
func TestRedisClusterSpreadsKeysAndRunsOnce(t *testing.T) {
	t.Parallel()
	rc := testsvc.StartRedisCluster(t)
	b := clusterLedger(t, rc, 2*time.Second)
	ctx := context.Background()
	const keys, racers, waves = 240, 4, 12
	var runs sync.Map
	var dispositions [5]atomic.Int64

	// Waves of keys; within a wave each key's racers start together and
	// the winner holds the key until another racer of it was answered.
	for w := 0; w < waves; w++ {
		var wg sync.WaitGroup
		errs := make(chan error, keys/waves*racers)
		for k := w * keys / waves; k < (w+1)*keys/waves; k++ {
			id := fmt.Sprintf("c-%d", k)
			var answered atomic.Int64
			start := make(chan struct{})
			fn := func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
				deadline := time.Now().Add(10 * time.Second)
				for answered.Load() == 0 && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
				return effect(id, &runs)(ctx, tx)
			}
			for r := 0; r < racers; r++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					first, err := b.ledger.Do(ctx, req("cluster", id), fn)
					if err != nil {
						errs <- err
						return
					}
					answered.Add(1)
					dispositions[first.Disposition].Add(1)
					if first.Disposition == inbox.InFlight {
						if _, err := doUntilAnswered(ctx, b.ledger, req("cluster", id), fn); err != nil {
							errs <- err
						}
					}
				}()
			}
			close(start)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err)
		}
	}

	runs.Range(func(k, v any) bool {
		require.EqualValues(t, 1, v.(*atomic.Int64).Load(), "handler of %s ran once", k)
		return true
	})
	requireExactlyOnce(t, b, "cluster", keys)
	c := b.ledger.Counters()
	require.EqualValues(t, keys, c.Executed)
	require.EqualValues(t, keys, dispositions[inbox.Executed].Load())
	require.GreaterOrEqual(t, dispositions[inbox.InFlight].Load(), int64(keys), "each key's racers met its winner in flight")
	require.Zero(t, c.RedisFallbacks, "the cluster answered every call")

	// Every key's result is cached on the master owning its slot, and the
	// keys spread over all three masters.
	perMaster := make([]int, len(rc.Addrs))
	for i := range rc.Addrs {
		n := rc.NodeClient(t, i)
		var cursor uint64
		for page := 0; page < 1000; page++ {
			ks, next, err := n.Scan(ctx, cursor, "justonce:*:res", 500).Result()
			require.NoError(t, err)
			perMaster[i] += len(ks)
			if cursor = next; cursor == 0 {
				break
			}
		}
	}
	total := 0
	for i, n := range perMaster {
		require.Greater(t, n, keys/10, "master %s holds a share of the keys: %v", rc.Addrs[i], perMaster)
		total += n
	}
	require.Equal(t, keys, total, "one cached result per key: %v", perMaster)
	cl := rc.NodeClient(t, 0)
	for k := 0; k < keys; k += 37 {
		res, lock := b.ledger.RedisKeys(req("cluster", fmt.Sprintf("c-%d", k)).Key)
		require.True(t, strings.HasSuffix(res, ":res") && strings.HasSuffix(lock, ":lock"))
		rs, err := cl.ClusterKeySlot(ctx, res).Result()
		require.NoError(t, err)
		ls, err := cl.ClusterKeySlot(ctx, lock).Result()
		require.NoError(t, err)
		require.Equal(t, rs, ls, "a key's lock and result share a slot")
	}

	// Replays: answered from the cluster, no Postgres connection taken.
	before, hits := b.pg.Pool.Stat().AcquireCount(), c.CacheHits
	for k := 0; k < keys; k++ {
		out, err := b.ledger.Do(ctx, req("cluster", fmt.Sprintf("c-%d", k)), effect("never", &runs))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.True(t, out.Cached)
		require.Equal(t, fmt.Sprintf("c-%d", k), string(out.Result.Body))
	}
	require.EqualValues(t, 0, b.pg.Pool.Stat().AcquireCount()-before)
	c = b.ledger.Counters()
	require.EqualValues(t, keys, c.CacheHits-hits)
	requireExactlyOnce(t, b, "cluster", keys)
	t.Logf("masters=%v first answers: executed=%d inflight=%d duplicate=%d; cache hits=%d (replay pass %d) fallbacks=%d",
		perMaster, dispositions[inbox.Executed].Load(), dispositions[inbox.InFlight].Load(),
		dispositions[inbox.Duplicate].Load(), c.CacheHits, c.CacheHits-hits, c.RedisFallbacks)
}

// TestRedisClusterMasterKilled SIGKILLs one of three masters in the middle
// of 3,000 keyed operations (1,500 keys, each delivered twice, by 8
// workers): work goes on through Postgres while the master is gone and
// after the cluster declares itself failed, the fallbacks are counted, the
// restarted master (same port, same nodes file, no data) serves again,
// and every key has exactly one effect and one done ledger row.
func TestRedisClusterMasterKilled(t *testing.T) {
	t.Parallel()
	rc := testsvc.StartRedisCluster(t)
	b := clusterLedger(t, rc, time.Second)
	ctx := context.Background()
	const ops, unique, workers = 3000, 1500, 8
	var runs sync.Map
	var next, done, doneWhileDown atomic.Int64
	var down atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= ops {
					return
				}
				id := fmt.Sprintf("k-%d", i%unique)
				if _, err := doUntilAnswered(ctx, b.ledger, req("killed", id), effect(id, &runs)); err != nil {
					errs <- err
					return
				}
				done.Add(1)
				if down.Load() {
					doneWhileDown.Add(1)
				}
			}
		}()
	}
	testsvc.Eventually(t, 30*time.Second, func() bool { return done.Load() >= ops/4 }, "first quarter done")
	rc.Kill(t, 0)
	down.Store(true)
	killedAt := done.Load()
	// The surviving masters mark the dead one failed after the node
	// timeout and refuse every slot (full coverage required): all calls
	// then go through Postgres.
	testsvc.Eventually(t, 20*time.Second, func() bool { return rc.State(1) == "fail" && rc.State(2) == "fail" }, "cluster declares itself failed")
	failedAt, fallbacksAtFail := done.Load(), b.ledger.Counters().RedisFallbacks
	testsvc.Eventually(t, 30*time.Second, func() bool { return done.Load() >= failedAt+300 }, "work goes on while the cluster is failed")
	down.Store(false)
	fallbacks := b.ledger.Counters().RedisFallbacks
	// Every call that started while the cluster was failed fell back; a
	// worker's call may have started just before.
	require.GreaterOrEqual(t, fallbacks-fallbacksAtFail, uint64(300-workers), "fallbacks counted while the cluster was failed")
	rc.Restart(t, 0)
	hitsAtRestart := b.ledger.Counters().CacheHits
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.EqualValues(t, ops, done.Load())
	require.GreaterOrEqual(t, doneWhileDown.Load(), int64(300), "operations kept flowing while a master was dead")

	// The cluster serves again, the restarted master too: each key is
	// cached on one pass and answered from Redis on the next.
	for pass := 0; pass < 2; pass++ {
		for i := 0; i < unique; i++ {
			id := fmt.Sprintf("k-%d", i)
			testsvc.Eventually(t, 15*time.Second, func() bool {
				out, err := b.ledger.Do(ctx, req("killed", id), effect("never-"+id, &runs))
				require.NoError(t, err)
				require.NotEqual(t, inbox.Executed, out.Disposition)
				return out.Disposition == inbox.Duplicate && (pass == 0 || out.Cached)
			}, "duplicate of %s answered from the cache", id)
		}
	}
	n0 := rc.NodeClient(t, 0)
	onRestarted, err := n0.DBSize(ctx).Result()
	require.NoError(t, err)
	require.Greater(t, onRestarted, int64(unique/10), "the restarted master holds cached results again")

	runs.Range(func(k, v any) bool {
		require.EqualValues(t, 1, v.(*atomic.Int64).Load(), "handler of %s ran once", k)
		return true
	})
	requireExactlyOnce(t, b, "killed", unique)
	c := b.ledger.Counters()
	require.Greater(t, c.CacheHits, hitsAtRestart)
	t.Logf("ops=%d done at kill=%d at cluster fail=%d while down=%d; fallbacks: before fail=%d while failed=%d total=%d; cache hits after restart=%d; keys on restarted master=%d",
		done.Load(), killedAt, failedAt, doneWhileDown.Load(), fallbacksAtFail, fallbacks-fallbacksAtFail, c.RedisFallbacks,
		c.CacheHits-hitsAtRestart, onRestarted)
}
