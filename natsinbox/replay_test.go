package natsinbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/internal/testsvc"
)

func TestReplayRunsOnlyWhatIsMissing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t)
	subject := testsvc.Unique("replay")
	stream := e.stream(t, subject, 0)
	for i := 0; i < 60; i++ {
		e.publish(t, subject, fmt.Sprintf("e-%d", i), []byte("v"))
	}
	// The live durable processes the first 60, then stops.
	c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "live", Processor: fx.processor("orders")}, fx.insert)
	require.NoError(t, err)
	stop := run(t, c)
	testsvc.Eventually(t, 30*time.Second, func() bool { return fx.pg.Count(t, `SELECT count(*) FROM effects`) == 60 }, "live consumer done")
	stop()
	for i := 60; i < 100; i++ {
		e.publish(t, subject, fmt.Sprintf("e-%d", i), []byte("v"))
	}
	before := e.consumerInfo(t, stream, "live")

	pc := fx.processor("orders")
	pc.ID = DefaultID // as the live consumer: the front's default
	p, err := consumer.New(pc, fx.insert)
	require.NoError(t, err)
	cfg := ReplayConfig{Conn: e.nc, Stream: stream, FetchWait: 500 * time.Millisecond}
	ctx := context.Background()

	dry, err := Replay(ctx, cfg, p, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 100, dry.Total.Seen)
	require.EqualValues(t, 60, dry.Total.Skipped)
	require.EqualValues(t, 40, dry.Total.Ran)
	require.Equal(t, 60, fx.pg.Count(t, `SELECT count(*) FROM effects`), "a dry run changes nothing")
	// The Consumer's own Replay: its stream, its handler, its ID and scope.
	viaConsumer, err := c.Replay(ctx, ReplayConfig{FetchWait: 500 * time.Millisecond}, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, dry.Total.Skipped, viaConsumer.Total.Skipped)
	require.Equal(t, dry.Total.Ran, viaConsumer.Total.Ran)

	// The end is where the stream stood when the replay began.
	src, err := NewReplaySource(ctx, cfg)
	require.NoError(t, err)
	e.publish(t, subject, "late", []byte("v"))
	rep, err := p.Replay(ctx, src, consumer.ReplayOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 100, rep.Total.Seen)
	require.EqualValues(t, 60, rep.Total.Skipped)
	require.EqualValues(t, 40, rep.Total.Ran)
	require.EqualValues(t, 1, rep.Partitions[0].First)
	require.EqualValues(t, 100, rep.Partitions[0].Last)
	require.Equal(t, 100, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	require.Equal(t, 100, fx.pg.Count(t, `SELECT count(*) FROM effects`))

	// The live durable was not disturbed.
	after := e.consumerInfo(t, stream, "live")
	require.Equal(t, before.AckFloor.Stream, after.AckFloor.Stream)

	// From a sequence: only the tail.
	cfg.StartSeq = 91
	rep, err = Replay(ctx, cfg, p, consumer.ReplayOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 11, rep.Total.Seen) // 91..100 and "late"
	require.EqualValues(t, 10, rep.Total.Skipped)
	require.EqualValues(t, 1, rep.Total.Ran)
}
