package natsinbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
)

// The package's Replay, with a Processor configured as the Consumer's (its
// scope, DefaultID), counts what the Consumer's own Replay counts. A replay
// reports the stream as partition 0, with its first and last sequences;
// from StartSeq it reads only the tail. (What every front's replay must do
// is the conformance suite's.)
func TestReplayFromASequence(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t)
	subject := testsvc.Unique("replayseq")
	stream := e.stream(t, subject, 0)
	const n = 20
	for i := 0; i < n; i++ {
		e.publish(t, subject, fmt.Sprintf("e-%d", i), []byte("v"))
	}
	ctx := context.Background()
	c, err := New(Config{Conn: e.nc, Stream: stream, Durable: "live", Processor: fx.processor("orders")}, fx.insert)
	require.NoError(t, err)
	viaConsumer, err := c.Replay(ctx, ReplayConfig{FetchWait: 500 * time.Millisecond}, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)

	pc := fx.processor("orders")
	pc.ID = DefaultID // as the Consumer: the front's default
	p, err := consumer.New(pc, fx.insert)
	require.NoError(t, err)
	cfg := ReplayConfig{Conn: e.nc, Stream: stream, FetchWait: 500 * time.Millisecond}
	dry, err := Replay(ctx, cfg, p, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Equal(t, viaConsumer.Total, dry.Total)
	require.EqualValues(t, n, dry.Total.Ran)
	require.Len(t, dry.Partitions, 1)
	require.EqualValues(t, 1, dry.Partitions[0].First)
	require.EqualValues(t, n, dry.Partitions[0].Last)

	cfg.StartSeq = n - 3
	rep, err := Replay(ctx, cfg, p, consumer.ReplayOptions{})
	require.NoError(t, err)
	require.EqualValues(t, 4, rep.Total.Seen)
	require.EqualValues(t, 4, rep.Total.Ran)
	require.EqualValues(t, n-3, rep.Partitions[0].First)
	require.Equal(t, 4, fx.pg.Count(t, `SELECT count(*) FROM effects`))
}

// With Bind, Consumer.Replay reads what the bound durable gets (its filter,
// read from the server, also before Run), not the whole stream. And no
// replay runs the dead letters natsinbox stored: here they are in the same
// stream, under the durable's subject + ".dlq".
func TestReplayWithBindReadsTheDurablesSubjectsAndNoDeadLetters(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t)
	subject := testsvc.Unique("replaybind")
	ctx := context.Background()
	stream := "S-" + subject
	_, err := e.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: stream, Subjects: []string{subject, subject + ".other", subject + DeadLetterSuffix}, Storage: jetstream.FileStorage,
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = e.js.DeleteStream(context.Background(), stream) })
	_, err = e.js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: "ops", AckPolicy: jetstream.AckExplicitPolicy, FilterSubject: subject})
	require.NoError(t, err)
	for i := 0; i < 5; i++ {
		e.publish(t, subject, fmt.Sprintf("e-%d", i), []byte("v"))
	}
	e.publish(t, subject, "poison", []byte("poison"))
	for i := 0; i < 3; i++ {
		e.publish(t, subject+".other", fmt.Sprintf("other-%d", i), []byte("v"))
	}
	h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if string(m.Value) == "poison" {
			return consumer.Permanent(errors.New("poison"))
		}
		return fx.insert(ctx, tx, m)
	}
	cfg := Config{Conn: e.nc, Stream: stream, Durable: "ops", Bind: true, Processor: fx.processor("ops")}

	// Before Run: nothing done yet.
	c, err := New(cfg, h)
	require.NoError(t, err)
	rep, err := c.Replay(ctx, ReplayConfig{FetchWait: 500 * time.Millisecond}, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 6, rep.Total.Seen, "only the durable's subject")
	require.EqualValues(t, 6, rep.Total.Ran)

	// The live consumer runs the five and dead-letters the poison into the
	// stream.
	stop := run(t, c)
	st, err := e.js.Stream(ctx, stream)
	require.NoError(t, err)
	testsvc.Eventually(t, 20*time.Second, func() bool {
		info, err := st.Info(ctx)
		require.NoError(t, err)
		return fx.pg.Count(t, `SELECT count(*) FROM effects`) == 5 && info.State.Msgs == 10 && // the dead letter
			e.consumerInfo(t, stream, "ops").NumAckPending == 0
	}, "live consumer done, the poison dead-lettered into the stream")
	stop()
	runs := fx.runs.Load()

	// After Run, by a Consumer that did not run.
	c2, err := New(cfg, h)
	require.NoError(t, err)
	for _, dry := range []bool{true, false} {
		rep, err = c2.Replay(ctx, ReplayConfig{FetchWait: 500 * time.Millisecond}, consumer.ReplayOptions{DryRun: dry})
		require.NoError(t, err)
		require.EqualValues(t, 6, rep.Total.Seen, "dry run %v: only the durable's subject", dry)
		require.EqualValues(t, 5, rep.Total.Skipped)
		require.EqualValues(t, 1, rep.Total.Failed)
		require.Zero(t, rep.Total.Ran)
	}
	require.Equal(t, runs, fx.runs.Load(), "the replay ran no handler")

	// The whole stream, the dead letter included: it is read past.
	pc := fx.processor("ops")
	pc.ID = DefaultID
	p, err := consumer.New(pc, h)
	require.NoError(t, err)
	rep, err = Replay(ctx, ReplayConfig{Conn: e.nc, Stream: stream, FetchWait: 500 * time.Millisecond}, p, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 9, rep.Total.Seen, "all but the dead letter")
	require.EqualValues(t, 3, rep.Total.Ran, "the other subject's events")
	require.EqualValues(t, 9, rep.Partitions[0].Last)
}

// A replay whose read waits in vain while the stream still holds messages
// up to its end (the server slow to see the pull request) reads on: it
// ends with every message, not with a part of them and no error.
func TestReplayReadsOnAfterAStall(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t)
	subject := testsvc.Unique("replaystall")
	stream := e.stream(t, subject, 0)
	// More than one fetch holds: the stall hits the second.
	const total = replayBatch + 10
	for i := 0; i < total; i++ {
		e.publish(t, subject, fmt.Sprintf("e-%d", i), []byte("v"))
	}
	const fetchWait = 500 * time.Millisecond
	// The stall outlasts the read's wait: the read gives up before the
	// server gets its request.
	px := testsvc.Proxy(t, strings.TrimPrefix(e.url, "nats://"))
	nc := connect(t, "nats://"+px.Addr())
	pc := fx.processor("orders")
	pc.ID = DefaultID
	var n atomic.Int64
	stalled := make(chan (<-chan struct{}), 1)
	p, err := consumer.New(pc, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if n.Add(1) == 5 {
			// Stall the next read's pull request.
			stalled <- px.StallWhenClientSends([]byte(".CONSUMER.MSG.NEXT."), 6*fetchWait)
		}
		return fx.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rep, err := Replay(ctx, ReplayConfig{Conn: nc, Stream: stream, FetchWait: fetchWait}, p, consumer.ReplayOptions{})
	require.NoError(t, err)
	select {
	case <-<-stalled:
	default:
		t.Fatal("the stall did not happen")
	}
	require.EqualValues(t, total, rep.Total.Seen)
	require.EqualValues(t, total, rep.Total.Ran)
	require.EqualValues(t, total, rep.Partitions[0].Last)
	require.Equal(t, total, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
}

// A message larger than a fetch's byte limit (a server may allow payloads
// over the replay's limit) is read all the same, alone, and the replay
// goes on in batches.
func TestReplayReadsAMessageLargerThanAFetch(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	subject := testsvc.Unique("replaybig")
	stream := e.stream(t, subject, 0)
	big := bytes.Repeat([]byte("x"), 64<<10)
	for i := 0; i < 6; i++ {
		v := []byte("small")
		if i == 2 {
			v = big
		}
		e.publish(t, subject, fmt.Sprintf("e-%d", i), v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	src, err := NewReplaySource(ctx, ReplayConfig{Conn: e.nc, Stream: stream, FetchWait: 300 * time.Millisecond})
	require.NoError(t, err)
	src.maxBytes = 16 << 10 // below the big message
	var got []int64
	for {
		m, err := src.Next(ctx)
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		got = append(got, m.Offset)
		if m.Offset == 3 {
			require.Len(t, m.Value, len(big))
		}
	}
	require.Equal(t, []int64{1, 2, 3, 4, 5, 6}, got)
}

// From a time: the first message stored at or after it, to the end.
func TestReplayFromATime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	fx := newFixture(t)
	subject := testsvc.Unique("replaytime")
	stream := e.stream(t, subject, 0)
	for i := 0; i < 10; i++ {
		e.publish(t, subject, fmt.Sprintf("e-%d", i), []byte("v"))
	}
	ctx := context.Background()
	st, err := e.js.Stream(ctx, stream)
	require.NoError(t, err)
	sixth, err := st.GetMsg(ctx, 6)
	require.NoError(t, err)
	pc := fx.processor("orders")
	pc.ID = DefaultID
	p, err := consumer.New(pc, fx.insert)
	require.NoError(t, err)

	rep, err := Replay(ctx, ReplayConfig{Conn: e.nc, Stream: stream, StartTime: sixth.Time}, p, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.EqualValues(t, 5, rep.Total.Seen)
	require.EqualValues(t, 6, rep.Partitions[0].First)
	require.EqualValues(t, 10, rep.Partitions[0].Last)

	// After the last message: nothing, at once.
	start := time.Now()
	rep, err = Replay(ctx, ReplayConfig{Conn: e.nc, Stream: stream, StartTime: time.Now().Add(time.Hour), FetchWait: time.Minute}, p, consumer.ReplayOptions{DryRun: true})
	require.NoError(t, err)
	require.Zero(t, rep.Total.Seen)
	require.Less(t, time.Since(start), 30*time.Second, "no wait for a message")
}
