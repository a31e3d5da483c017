package consumertest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
)

// testReplay: a live consumer ran every event; a restore from an older
// backup then lost the last events' effects and ledger rows. Replaying
// the topic from its start through the same handler, with the front's own
// replay: a dry run counts what would run and runs nothing; the replay
// runs only the missing events (the ledger skips the others) and ends
// where the topic stood when it began (events published while it runs are
// not part of it); a replay from a time reads only what came after it; and
// no replay acknowledges anything for the live group.
func testReplay(t *testing.T, s *suite) {
	h := s.h.(ReplayHarness)
	fx := newFixture(t, h)
	topic := h.NewTopic(t)
	group, scope := "g-"+topic, "replay-"+topic
	const n, lost, late, later = 400, 100, 10, 30
	h.Publish(t, topic, events("p", 0, n, 20))

	stop := h.Start(t, topic, group, fx.options(scope, fx.insert))
	eventually(t, 60*time.Second, func() bool { return fx.effects(t) >= n }, "consumed")
	waitAcked(t, h, topic, group)
	stop()

	// A restore from an older backup lost the last events' effects and
	// ledger rows.
	fx.exec(t, `DELETE FROM effects WHERE (regexp_replace(event_id, '^p-', ''))::int >= $1`, n-lost)
	fx.exec(t, `DELETE FROM processed_events WHERE (regexp_replace(event_id, '^p-', ''))::int >= $1`, n-lost)
	runs := fx.runs.Load()

	dry, err := h.Replay(t, topic, group, fx.options(scope, fx.insert), time.Time{}, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.True(t, dry.DryRun)
	requireReport(t, dry, n, lost, n-lost, "dry run")
	require.Equal(t, n-lost, fx.effects(t), "a dry run changes nothing")
	require.Equal(t, runs, fx.runs.Load(), "a dry run runs no handler")

	// The first handler the replay runs has the test publish more events:
	// the replay has begun, so they are not part of it.
	began, published := make(chan struct{}), make(chan struct{})
	var once sync.Once
	replaying := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		once.Do(func() {
			close(began)
			<-published
		})
		return fx.insert(ctx, tx, m)
	}
	type result struct {
		rep   consumer.ReplayReport
		err   error
		ended bool // Replay returned: the Harness did not fail the test
	}
	done := make(chan result, 1)
	go func() {
		var r result
		defer func() { done <- r }() // also when the Harness fails the test here
		r.rep, r.err = h.Replay(t, topic, group, fx.options(scope, replaying), time.Time{}, consumer.ReplayOptions{})
		r.ended = true
	}()
	select {
	case <-began:
	case r := <-done:
		t.Fatalf("the replay ended (%v, %v) without running a handler", r.rep, r.err)
	case <-time.After(60 * time.Second):
		t.Fatal("the replay ran no handler within 60s")
	}
	h.Publish(t, topic, events("late", 0, late, 20))
	close(published)
	var r result
	select {
	case r = <-done:
	case <-time.After(120 * time.Second):
		t.Fatal("the replay did not end within 120s")
	}
	require.True(t, r.ended, "the Harness's Replay failed")
	require.NoError(t, r.err)
	requireReport(t, r.rep, n, lost, n-lost, "replay (the events published while it ran are not part of it)")
	require.EqualValues(t, lost, fx.runs.Load()-runs, "only the missing events ran")
	fx.assertExactlyOnce(t, n)

	// From a time: only what was stored after it. The late events were
	// stored before it, and no replay ran them.
	mark := time.Now()
	h.Publish(t, topic, events("new", 0, later, 20))
	rep, err := h.Replay(t, topic, group, fx.options(scope, fx.insert), mark, consumer.ReplayOptions{})
	require.NoError(t, err)
	requireReport(t, rep, later, later, 0, "replay from a time")
	require.Equal(t, n+later, fx.effects(t))
	require.Zero(t, fx.count(t, `SELECT count(*) FROM effects WHERE event_id LIKE 'late-%'`), "the late events never ran")

	// The live group's position was not touched by the replays.
	require.Equal(t, late+later, h.Pending(t, topic, group), "replays acknowledge nothing for the group")
}

// requireReport checks a replay's totals, and that its partitions add up
// to them.
func requireReport(t *testing.T, rep consumer.ReplayReport, seen, ran, skipped int, what string) {
	t.Helper()
	require.EqualValues(t, seen, rep.Total.Seen, "%s: seen", what)
	require.EqualValues(t, ran, rep.Total.Ran, "%s: ran", what)
	require.EqualValues(t, skipped, rep.Total.Skipped, "%s: skipped", what)
	require.Zero(t, rep.Total.Failed+rep.Total.NoID, "%s: failed or without an ID", what)
	var sum int64
	for _, p := range rep.Partitions {
		sum += p.Seen
	}
	require.EqualValues(t, seen, sum, "%s: the partitions' reports add up to the total", what)
}
