package failover_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/ledgerkey"
	"github.com/justonce/justonce/metrics"
)

// counter reads a counter of reg.
func counter(t *testing.T, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// TestRedisSentinelFailoverPostgresDecides: the ledger's Redis fast path
// runs through a Sentinel client (a master, a replica, three sentinels)
// while eight workers call Do, each key delivered by two at once. Four
// handlers hold their keys, their Redis locks written to the master only
// (the replica cut off), when the master is SIGKILLed; the sentinels
// promote the replica, which never received those locks. Duplicates of
// the held keys then take the Redis lock on the new master and are turned
// away by Postgres (InFlight): 0 doubled, 0 lost. The fallbacks rise
// during the outage and stop once the new master answers, when the
// recoveries counter rises.
func TestRedisSentinelFailoverPostgresDecides(t *testing.T) {
	ctx := context.Background()
	rs := testsvc.StartRedisSentinel(t)
	pg := testsvc.Postgres(t, testsvc.MaxConns(16))
	createEffects(t, pg.Pool)
	prefix := testsvc.Unique("t") + ":"
	l, err := inbox.New(pg.Pool, inbox.Config{Schema: pg.Schema,
		Redis: &inbox.RedisConfig{Client: rs.Client(t), Prefix: prefix, Timeout: time.Second}})
	require.NoError(t, err)
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{DisableStats: true}))
	fallbacks := func() float64 { return counter(t, reg, "justonce_ledger_redis_fallbacks_total") }
	recoveries := func() float64 { return counter(t, reg, "justonce_ledger_redis_recoveries_total") }

	w := newWorkload(l, "sentinel")
	stop := w.start(t, 8)
	w.waitDone(t, 300, 30*time.Second)
	require.Zero(t, fallbacks(), "the master answers")

	// Four keys held by their handlers, their Redis locks on the master
	// alone.
	rs.CutReplication()
	master := rs.Master()
	var held []string
	var holds []*hold
	var heldWG sync.WaitGroup
	heldErrs := make(chan error, 4)
	for i := range 4 {
		id := fmt.Sprintf("held-%d", i)
		held, holds = append(held, id), append(holds, w.hold(id))
		heldWG.Go(func() { heldErrs <- w.deliver(id) })
		<-holds[i].running
	}
	lockOf := func(id string) string {
		_, lock := ledgerkey.RedisKeys(prefix, "sentinel", "", id)
		return lock
	}
	for _, id := range held {
		n, err := rs.NodeClient(t, master).Exists(ctx, lockOf(id)).Result()
		require.NoError(t, err)
		require.EqualValues(t, 1, n, "%s locked on the master", id)
		n, err = rs.NodeClient(t, 1-master).Exists(ctx, lockOf(id)).Result()
		require.NoError(t, err)
		require.Zero(t, n, "%s's lock never reached the replica", id)
	}

	fallbacksAtKill, recoveriesAtKill := fallbacks(), recoveries()
	doneAtKill := w.done()
	old := rs.KillMaster()
	killed := time.Now()
	rs.WaitFailover(old, 30*time.Second)
	failedOver := time.Since(killed)
	doneDuringOutage := w.done() - doneAtKill
	require.Greater(t, fallbacks(), fallbacksAtKill, "calls fell back to Postgres during the outage")

	// The promoted replica never had the held keys' locks: their
	// duplicates take the Redis lock and Postgres turns them away.
	for _, id := range held {
		n, err := rs.NodeClient(t, 1-old).Exists(ctx, lockOf(id)).Result()
		require.NoError(t, err)
		require.Zero(t, n, "the new master lacks %s's lock", id)
		out, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "sentinel", ID: id}}, w.effect(id))
		for inbox.IsTransient(err) { // a pooled connection of the dead master
			out, err = l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "sentinel", ID: id}}, w.effect(id))
		}
		require.NoError(t, err)
		require.Equal(t, inbox.InFlight, out.Disposition, "Postgres holds %s while its handler runs", id)
	}
	for _, h := range holds {
		close(h.release)
	}
	heldWG.Wait()
	close(heldErrs)
	for err := range heldErrs {
		require.NoError(t, err)
	}

	// Back to Redis: the recoveries counter rises, then the fallbacks stop
	// rising while the workers go on.
	testsvc.Eventually(t, 30*time.Second, func() bool { return recoveries() > recoveriesAtKill }, "the fast path is back")
	back := time.Since(killed)
	testsvc.Eventually(t, 30*time.Second, func() bool {
		f := fallbacks()
		w.waitDone(t, 300, 30*time.Second)
		return fallbacks() == f
	}, "300 calls without a fallback")
	fallbacksAfter := fallbacks()
	rs.Restart(old)
	w.waitDone(t, 300, 30*time.Second)
	require.NoError(t, stop())
	require.Equal(t, fallbacksAfter, fallbacks(), "no fallback once the new master answers, nor when the old one comes back as its replica")

	keys := w.requireOnce(t, pg.Pool)
	for _, id := range held {
		require.Equal(t, inbox.Executed, w.acked[id])
	}
	c := l.Counters()
	t.Logf("master node %d killed; sentinels settled on node %d %s after the kill; fast path back (first recovery) within %s; Do calls acknowledged during the failover %d; fallbacks %v (during the outage %v), recoveries %v; keys acknowledged=%d executed=%d duplicates=%d (cache hits %d) in-flight answers=%d",
		old, 1-old, failedOver.Round(time.Millisecond), back.Round(time.Millisecond), doneDuringOutage, fallbacks(), fallbacksAfter-fallbacksAtKill,
		recoveries(), keys, c.Executed, c.Duplicates, c.CacheHits, w.inFlight.Load())
}
