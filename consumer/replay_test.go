package consumer_test

import (
	"context"
	"fmt"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
)

func TestReplayRunsOnlyTheMissing(t *testing.T) {
	t.Parallel()
	f := setup(t)
	p, err := consumer.New(f.cfg(), f.insert)
	require.NoError(t, err)
	ctx := context.Background()
	var all []*consumer.Message
	for i := 0; i < 100; i++ {
		m := msg(fmt.Sprintf("e%d", i))
		m.Partition, m.Offset = i%2, int64(i/2)
		all = append(all, m)
	}
	// The live consumer got through the first 60.
	for _, m := range all[:60] {
		require.Equal(t, consumer.Ack, p.Process(ctx, m).Action)
	}
	fresh := func() *sliceSource {
		s := sliceSource{}
		for _, m := range all {
			c := *m
			c.ID = ""
			s = append(s, &c)
		}
		s = append(s, msg("")) // one without an ID
		return &s
	}

	dry, err := p.Replay(ctx, fresh(), consumer.ReplayOptions{DryRun: true, LookupBatch: 7})
	require.NoError(t, err)
	require.EqualValues(t, 101, dry.Total.Seen)
	require.EqualValues(t, 60, dry.Total.Skipped)
	require.EqualValues(t, 40, dry.Total.Ran)
	require.EqualValues(t, 1, dry.Total.NoID)
	require.Equal(t, 60, f.pg.Count(t, `SELECT count(*) FROM effects`), "dry run changes nothing")

	var progress int
	rep, err := p.Replay(ctx, fresh(), consumer.ReplayOptions{Progress: func(consumer.ReplayReport) { progress++ }})
	require.NoError(t, err)
	require.EqualValues(t, 101, rep.Total.Seen)
	require.EqualValues(t, 60, rep.Total.Skipped)
	require.EqualValues(t, 40, rep.Total.Ran)
	require.EqualValues(t, 1, rep.Total.NoID)
	require.Len(t, rep.Partitions, 2)
	require.EqualValues(t, rep.Total.Seen, rep.Partitions[0].Seen+rep.Partitions[1].Seen)
	require.GreaterOrEqual(t, progress, 1)
	require.Equal(t, 100, f.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, 100, f.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))

	// Replaying again runs nothing.
	rep, err = p.Replay(ctx, fresh(), consumer.ReplayOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 100, rep.Total.Skipped)
	require.Zero(t, rep.Total.Ran)
}

// sliceSource replays a fixed list of messages.
type sliceSource []*consumer.Message

// Next returns the next message or io.EOF.
func (s *sliceSource) Next(ctx context.Context) (*consumer.Message, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if len(*s) == 0 {
		return nil, io.EOF
	}
	m := (*s)[0]
	*s = (*s)[1:]
	return m, nil
}

// A dry run predicts the real run: an ID that the source repeats runs once,
// and counts once as would run, also when its copies fall in different
// ledger lookups (LookupBatch).
func TestReplayDryRunCountsARepeatOnceAcrossLookupBatches(t *testing.T) {
	t.Parallel()
	f := setup(t)
	p, err := consumer.New(f.cfg(), f.insert)
	require.NoError(t, err)
	ctx := context.Background()
	require.Equal(t, consumer.Ack, p.Process(ctx, msg("done")).Action)
	src := func() *sliceSource {
		// Lookups of 2: [a b] [done a] [c b] [a]
		s := sliceSource{msg("a"), msg("b"), msg("done"), msg("a"), msg("c"), msg("b"), msg("a")}
		return &s
	}

	dry, err := p.Replay(ctx, src(), consumer.ReplayOptions{DryRun: true, LookupBatch: 2})
	require.NoError(t, err)
	require.EqualValues(t, 7, dry.Total.Seen)
	require.EqualValues(t, 3, dry.Total.Ran, "a, b and c would run, once each")
	require.EqualValues(t, 4, dry.Total.Skipped)

	real, err := p.Replay(ctx, src(), consumer.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, dry.Total.Ran, real.Total.Ran)
	require.Equal(t, dry.Total.Skipped, real.Total.Skipped)
	require.Equal(t, 4, f.pg.Count(t, `SELECT count(*) FROM effects`))
}
