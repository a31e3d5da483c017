package failover_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/metrics"
)

// TestPostgresSyncFailoverLosesAndDoublesNothing: eight workers call
// Ledger.Do, each key delivered by two of them at once, through a pool on
// the replica set's multi-host connection string, while the primary is
// SIGKILLed and the synchronous standby promoted, three times (the dead
// node rebuilt as the new standby in between). The ledger follows each new
// primary without a restart; every key answered Executed or Duplicate has
// exactly one effect on the last primary, none has two, and the time from
// each kill to the first commit of a Do started after it is logged.
func TestPostgresSyncFailoverLosesAndDoublesNothing(t *testing.T) {
	rs := testsvc.StartPostgresReplicaSet(t, testsvc.PGReplicaSetConfig{Synchronous: true})
	pool := rs.Pool(t, 16)
	migrate(t, pool)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	w := newWorkload(l, "sync")
	stop := w.start(t, 8)

	const failovers = 3
	var resumes, promotes []time.Duration
	for f := 0; f < failovers; f++ {
		w.waitDone(t, 300, 30*time.Second)
		before := w.transient.Load()
		old := rs.KillPrimary()
		killed := time.Now() // every process of the old primary is gone
		rs.Promote()
		promoted := time.Since(killed)
		resumed := w.waitResumed(t, killed, 30*time.Second)
		require.Greater(t, w.transient.Load(), before, "the workers felt the failover")
		rs.RebuildStandby()
		t.Logf("failover %d: node %d killed, node %d promoted (Promote returned) %s after the kill, first Do started after the kill committed %s after it; node %d rebuilt as its standby %s after it",
			f+1, old, rs.Primary(), promoted.Round(time.Millisecond), resumed.Round(time.Millisecond), old, time.Since(killed).Round(time.Millisecond))
		resumes, promotes = append(resumes, resumed), append(promotes, promoted)
		// The pool now reaches the new primary.
		var port int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT inet_server_port()`).Scan(&port))
		require.Equal(t, rs.Port(rs.Primary()), port)
	}
	w.waitDone(t, 300, 30*time.Second)
	require.NoError(t, stop())
	keys := w.requireOnce(t, pool)
	require.Positive(t, w.inFlight.Load(), "concurrent duplicates met each other")
	c := l.Counters()
	t.Logf("keys acknowledged=%d executed=%d duplicates=%d in-flight answers=%d transient errors=%d %v handler runs=%d; promote after kill %v; first Do committed after kill %v",
		keys, c.Executed, c.Duplicates, w.inFlight.Load(), w.transient.Load(), w.errorKinds(), w.runs.Load(), promotes, resumes)
}

// replicationGauges scrapes a LedgerCollector with Replication set.
func replicationGauges(t *testing.T, l *inbox.Ledger) map[string]float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.NewLedgerCollector(l, metrics.LedgerConfig{Replication: true, DisableStats: true}))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if g := mf.GetMetric()[0].GetGauge(); g != nil {
			out[mf.GetName()] = g.GetValue()
		}
	}
	return out
}

// checkReplication is Ledger.CheckReplication retried while it fails for
// the time being (a pooled connection to a server that died).
func checkReplication(l *inbox.Ledger) (inbox.Replication, error) {
	end := time.Now().Add(10 * time.Second)
	for {
		rep, err := l.CheckReplication(context.Background())
		if !inbox.IsTransient(err) || time.Now().After(end) {
			return rep, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestPostgresSyncCommitWaitsForTheStandby: with synchronous replication
// the ledger's check and metric say its commits are durable; a Do whose
// standby is cut off is not acknowledged (its COMMIT waits, invisible to
// other sessions: a duplicate is InFlight, a look-up finds nothing), and when the
// primary is killed then, the call fails with ErrCommitUnknown; after the
// promotion the retry runs the handler again and its effect is there
// once. The promoted primary has no standby until the dead node is
// rebuilt: the check says so, and says durable again after.
func TestPostgresSyncCommitWaitsForTheStandby(t *testing.T) {
	ctx := context.Background()
	rs := testsvc.StartPostgresReplicaSet(t, testsvc.PGReplicaSetConfig{Synchronous: true})
	pool := rs.Pool(t, 4)
	migrate(t, pool)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)

	rep, err := l.CheckReplication(ctx)
	require.NoError(t, err)
	require.True(t, rep.Durable())
	require.Equal(t, inbox.Replication{SynchronousCommit: "on", SynchronousStandbyNames: "*", Standbys: 1, SyncStandbys: 1}, rep)
	require.Equal(t, map[string]float64{"justonce_ledger_commit_durable": 1, "justonce_ledger_standbys": 1,
		"justonce_ledger_sync_standbys": 1, "justonce_ledger_replication_up": 1}, replicationGauges(t, l))

	// The ledger's sessions may turn synchronous_commit down themselves.
	local, err := pgxpool.New(ctx, rs.ConnString()+" synchronous_commit=local")
	require.NoError(t, err)
	defer local.Close()
	ll, err := inbox.New(local, inbox.Config{})
	require.NoError(t, err)
	_, err = ll.CheckReplication(ctx)
	require.ErrorIs(t, err, inbox.ErrNotReplicated)
	require.ErrorContains(t, err, `synchronous_commit is "local"`)
	local.Close()

	w := newWorkload(l, "sync")
	require.NoError(t, w.deliver("before"))
	rs.CutReplication()
	held := make(chan error, 1)
	go func() {
		_, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "sync", ID: "held"}}, w.effect("held"))
		held <- err
	}()
	// The COMMIT waits for the standby.
	primary, err := pgx.Connect(ctx, rs.NodeURL(rs.Primary()))
	require.NoError(t, err)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		var n int
		require.NoError(t, primary.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'`).Scan(&n))
		return n == 1
	}, "the Do's COMMIT waits for the standby")
	_ = primary.Close(ctx)
	select {
	case err := <-held:
		t.Fatalf("Do returned before the standby had its commit: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	// Waiting, the commit is not visible: no Duplicate can be answered
	// from it, and the key is held.
	_, err = l.Lookup(ctx, inbox.Key{Scope: "sync", ID: "held"})
	require.ErrorIs(t, err, inbox.ErrNotFound)
	out, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "sync", ID: "held"}}, w.effect("held"))
	require.NoError(t, err)
	require.Equal(t, inbox.InFlight, out.Disposition)
	rs.KillPrimary()
	err = <-held
	require.ErrorIs(t, err, inbox.ErrCommitUnknown, "the commit was in flight when the primary died")
	require.True(t, inbox.IsTransient(err))
	rs.Promote()

	rep, err = checkReplication(l)
	require.ErrorIs(t, err, inbox.ErrNotReplicated, "the promoted primary has no standby yet")
	require.ErrorContains(t, err, "no standby streams from the server")
	require.Zero(t, rep.Standbys)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		g := replicationGauges(t, l)
		return g["justonce_ledger_replication_up"] == 1 && g["justonce_ledger_commit_durable"] == 0
	}, "the metric says the commits are not durable")

	require.NoError(t, w.deliver("held"), "the retry of a commit in doubt")
	require.Equal(t, inbox.Executed, w.acked["held"], "the old primary's commit died with it: the handler ran again")
	require.EqualValues(t, 3, w.runs.Load())
	rs.RebuildStandby()
	_, err = checkReplication(l)
	require.NoError(t, err, "durable again with the rebuilt standby")
	require.NoError(t, w.deliver("held"))
	require.Equal(t, 2, w.requireOnce(t, pool))
}

// TestPostgresAsyncFailoverLosesAnAcknowledgedCommit shows what
// asynchronous replication costs, and fails if it stops happening: the
// ledger's check and metric say commits are not durable while a standby
// streams; a Do answered Executed (its commit acknowledged by the primary)
// while the standby was cut off is gone after the primary dies and the
// standby is promoted, with its effect, and the redelivery runs the
// handler a second time.
func TestPostgresAsyncFailoverLosesAnAcknowledgedCommit(t *testing.T) {
	ctx := context.Background()
	rs := testsvc.StartPostgresReplicaSet(t, testsvc.PGReplicaSetConfig{})
	pool := rs.Pool(t, 4)
	migrate(t, pool)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)

	rep, err := l.CheckReplication(ctx)
	require.ErrorIs(t, err, inbox.ErrNotReplicated)
	require.ErrorContains(t, err, "synchronous_standby_names is empty: the 1 standby(s) streaming from the server receive each commit after it was acknowledged")
	require.Equal(t, inbox.Replication{SynchronousCommit: "on", Standbys: 1}, rep)
	require.False(t, rep.Durable())
	require.Equal(t, map[string]float64{"justonce_ledger_commit_durable": 0, "justonce_ledger_standbys": 1,
		"justonce_ledger_sync_standbys": 0, "justonce_ledger_replication_up": 1}, replicationGauges(t, l))

	w := newWorkload(l, "async")
	require.NoError(t, w.deliver("kept"))
	rs.WaitStandbyCaughtUp()
	rs.CutReplication()
	require.NoError(t, w.deliver("lost"))
	require.Equal(t, inbox.Executed, w.acked["lost"], "the primary acknowledged the commit")
	rec, err := l.Lookup(ctx, inbox.Key{Scope: "async", ID: "lost"})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusDone, rec.Status)

	rs.KillPrimary()
	rs.Promote()
	_, err = lookup(t, l, inbox.Key{Scope: "async", ID: "kept"})
	require.NoError(t, err, "what the standby had received survives")
	_, err = lookup(t, l, inbox.Key{Scope: "async", ID: "lost"})
	require.ErrorIs(t, err, inbox.ErrNotFound, "the acknowledged commit is lost with the old primary")
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE id = 'lost'`).Scan(&effects))
	require.Zero(t, effects, "its effect too")

	out, err := l.Do(ctx, inbox.Request{Key: inbox.Key{Scope: "async", ID: "lost"}}, w.effect("lost"))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition, "the redelivery runs the handler again: its effect happened twice")
	require.EqualValues(t, 3, w.runs.Load())
}

// TestPostgresSwitchoverFromAFencedPrimary: a planned switchover under
// load: the primary is fenced read-only (default_transaction_read_only,
// which reaches its open sessions too) and stays up, the synchronous
// standby is promoted. The ledger's pooled connections to the old primary
// now have every write refused (SQLSTATE 25006); each is closed when that
// happens, so the pool's new connections find the new primary through
// the multi-host connection string (which skips the read-only server).
// Nothing is lost or doubled.
func TestPostgresSwitchoverFromAFencedPrimary(t *testing.T) {
	ctx := context.Background()
	rs := testsvc.StartPostgresReplicaSet(t, testsvc.PGReplicaSetConfig{Synchronous: true})
	pool := rs.Pool(t, 8)
	migrate(t, pool)
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	w := newWorkload(l, "switchover")
	stop := w.start(t, 8)
	w.waitDone(t, 300, 30*time.Second)
	old := rs.Primary()
	fence, err := pgx.Connect(ctx, rs.NodeURL(old))
	require.NoError(t, err)
	_, err = fence.Exec(ctx, `ALTER SYSTEM SET default_transaction_read_only = on`)
	require.NoError(t, err)
	_, err = fence.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	_ = fence.Close(ctx)
	fenced := time.Now()
	testsvc.Eventually(t, 10*time.Second, func() bool { return w.errorKinds()["25006"] > 0 }, "writes refused on the fenced primary")
	rs.WaitStandbyCaughtUp()
	rs.Promote()
	promotedAt := time.Now()
	promoted := promotedAt.Sub(fenced)
	// Sessions of the old primary read the new setting at their next
	// statement after the reload: the first commits after the fence may
	// still be its own. Count from the promotion.
	resumed := w.waitResumed(t, promotedAt, 30*time.Second)
	w.waitDone(t, 300, 30*time.Second)
	require.NoError(t, stop())
	var port int
	require.NoError(t, pool.QueryRow(ctx, `SELECT inet_server_port()`).Scan(&port))
	require.Equal(t, rs.Port(rs.Primary()), port)
	keys := w.requireOnce(t, pool)
	t.Logf("switchover: node %d fenced, node %d promoted (Promote returned) %s after, first Do started after the promotion committed %s after it; keys acknowledged=%d transient errors %v",
		old, rs.Primary(), promoted.Round(time.Millisecond), resumed.Round(time.Millisecond), keys, w.errorKinds())
}
