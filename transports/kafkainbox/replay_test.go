package kafkainbox_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// A replay reports each partition it read, with its first and last
// offsets; with ReplayConfig.Partitions and StartOffset it reads those
// partitions only, from that offset. (What every front's replay must do is
// the conformance suite's.)
func TestReplayPartitionsFromAnOffset(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 3)
	const per = 10
	for p := range 3 {
		publishTo(t, brokers, topic, p, events("p"+strconv.Itoa(p), 0, per, 1)...)
	}
	c, err := kafkainbox.New(kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: "g-" + topic, Processor: fx.processor()}, fx.insert)
	require.NoError(t, err)
	ctx := context.Background()

	rep, err := c.Replay(ctx, kafkainbox.ReplayConfig{}, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Len(t, rep.Partitions, 3)
	for i, p := range rep.Partitions {
		require.Equal(t, consumer.PartitionReport{Partition: i, Seen: per, Ran: per, First: 0, Last: per - 1}, p)
	}

	rep, err = c.Replay(ctx, kafkainbox.ReplayConfig{Partitions: []int{2, 0}, StartOffset: 4}, consumer.ReplayOptions{})
	require.NoError(t, err)
	require.Len(t, rep.Partitions, 2)
	for i, p := range rep.Partitions {
		require.Equal(t, consumer.PartitionReport{Partition: 2 * i, Seen: per - 4, Ran: per - 4, First: 4, Last: per - 1}, p)
	}
	fx.assertExactlyOnce(t, 2*(per-4))
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM effects WHERE part = 1 OR off < 4`))
}
