package kafkainbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// Replaying a topic through the same handler runs only what the ledger has
// not done; a dry run counts it first; the replay ends where the topic
// stood when it began and leaves the group's offsets alone.
func TestReplayRunsOnlyTheMissing(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 3)
	group := "g-" + topic
	const n, lost = 400, 100
	publish(t, brokers, topic, events("p", 0, n, 20)...)
	cfg := kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor(), Reader: tuneReader}

	stop := start(t, cfg, fx.insert)
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) >= n }, "consumed")
	waitNoLag(t, brokers, group, topic)
	stop()

	// A restore from an older backup lost the last 100 events' effects and
	// ledger rows.
	fx.pg.Exec(t, `DELETE FROM effects WHERE (regexp_replace(event_id, '^p-', ''))::int >= $1`, n-lost)
	fx.pg.Exec(t, `DELETE FROM processed_events WHERE (regexp_replace(event_id, '^p-', ''))::int >= $1`, n-lost)
	// Published after the replay opens: not part of it.
	src, err := kafkainbox.NewReplaySource(context.Background(), kafkainbox.ReplayConfig{Brokers: brokers, Topic: topic})
	require.NoError(t, err)
	publish(t, brokers, topic, events("late", 0, 10, 20)...)

	c, err := kafkainbox.New(cfg, fx.insert)
	require.NoError(t, err)
	dry, err := c.Replay(context.Background(), kafkainbox.ReplayConfig{}, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.True(t, dry.DryRun)
	require.EqualValues(t, n+10, dry.Total.Seen, "a replay opened later sees the late ones")
	require.EqualValues(t, lost+10, dry.Total.Ran, "would run")
	require.EqualValues(t, n-lost, dry.Total.Skipped)
	require.Len(t, dry.Partitions, 3)
	require.Equal(t, n-lost, fx.effects(t), "a dry run changes nothing")

	runsBefore := fx.runs.Load()
	p, err := consumer.New(func() consumer.Config { pc := fx.processor(); pc.Scope = group; return pc }(), fx.insert)
	require.NoError(t, err)
	rep, err := p.Replay(context.Background(), src, consumer.ReplayOptions{})
	require.NoError(t, src.Close())
	require.NoError(t, err)
	require.EqualValues(t, n, rep.Total.Seen, "the end was fixed when the source opened")
	require.EqualValues(t, lost, rep.Total.Ran)
	require.EqualValues(t, n-lost, rep.Total.Skipped)
	require.EqualValues(t, lost, fx.runs.Load()-runsBefore, "only the missing events ran")
	fx.assertExactlyOnce(t, n)

	// From a time: only what was published after it.
	mark := time.Now()
	time.Sleep(20 * time.Millisecond)
	publish(t, brokers, topic, events("new", 0, 30, 20)...)
	rep, err = c.Replay(context.Background(), kafkainbox.ReplayConfig{StartTime: mark}, consumer.ReplayOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 30, rep.Total.Seen)
	require.EqualValues(t, 30, rep.Total.Ran)
	require.Equal(t, n+30, fx.effects(t), "the late 10 are before the mark and were not in the earlier replay")

	// The group's offsets were not touched by the replays.
	l := lag(t, brokers, group, topic)
	var behind int64
	for _, v := range l {
		behind += v
	}
	require.EqualValues(t, 10+30, behind, "replays commit nothing")
}
