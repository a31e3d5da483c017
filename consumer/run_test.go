package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// ProcessRun decides a prefix in order: it ends at the first message not
// done, so that the caller retries it before the ones behind it run.
func TestProcessRunEndsAtTheFirstFailure(t *testing.T) {
	t.Parallel()
	f := setup(t)
	var mu sync.Mutex
	ran := map[string]int{}
	p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		ran[m.ID]++
		mu.Unlock()
		if m.ID == "bad" {
			return errors.New("bad payload")
		}
		return f.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	ctx := context.Background()
	msgs := []*consumer.Message{msg("a"), msg("b"), msg("bad"), msg("c"), msg("d")}
	ds := p.ProcessRun(ctx, msgs, consumer.RunLimits{})
	require.Len(t, ds, 3)
	require.Equal(t, consumer.Ack, ds[0].Action)
	require.Equal(t, consumer.Ack, ds[1].Action)
	require.Equal(t, consumer.Retry, ds[2].Action)
	require.True(t, ds[2].Counted)
	mu.Lock()
	// a and b ran twice: their first run went with the failed one's (the
	// run's optimistic transaction), then they ran again on savepoints.
	require.Equal(t, map[string]int{"a": 2, "b": 2, "bad": 1}, ran, "c and d did not run")
	mu.Unlock()
	require.Equal(t, 2, f.pg.Count(t, `SELECT count(*) FROM effects`))

	// The caller carries the retry on (here to the dead letter), then the rest.
	d := p.Retry(ctx, msgs[2], ds[2], nil)
	require.True(t, d.DeadLettered)
	ds = p.ProcessRun(ctx, msgs[3:], consumer.RunLimits{})
	require.Len(t, ds, 2)
	require.Equal(t, 4, f.pg.Count(t, `SELECT count(*) FROM effects`))

	// A message without an ID at the head is decided alone; behind a
	// keyed run it ends the run.
	ds = p.ProcessRun(ctx, []*consumer.Message{msg("e"), msg(""), msg("f")}, consumer.RunLimits{})
	require.Len(t, ds, 1, "e alone: the next has no ID")
	ds = p.ProcessRun(ctx, []*consumer.Message{msg(""), msg("f")}, consumer.RunLimits{})
	require.Len(t, ds, 1)
	require.True(t, ds[0].DeadLettered, "no ID: dead-lettered")
}

// With the Redis fast path, batches answer duplicates from Redis (no
// Postgres claim) and fill the cache after their commit.
func TestProcessRunUsesTheRedisFastPath(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t)
	pg.Exec(t, `CREATE TABLE effects (event_id text NOT NULL)`)
	client, prefix := testsvc.Redis(t)
	l, err := inbox.New(pg.Pool, inbox.Config{Redis: &inbox.RedisConfig{Client: client, Prefix: prefix, Timeout: 2 * time.Second}})
	require.NoError(t, err)
	f := &fx{pg: pg, ledger: l}
	var cached atomic.Int64
	cfg := f.cfg()
	cfg.Hooks.OnOutcome = func(_ *consumer.Message, out inbox.Outcome, _ time.Duration) {
		if out.Cached {
			cached.Add(1)
		}
	}
	p, err := consumer.New(cfg, f.insert)
	require.NoError(t, err)
	ctx := context.Background()
	batch := func(from, to int) []*consumer.Message {
		var ms []*consumer.Message
		for i := from; i < to; i++ {
			ms = append(ms, msg(fmt.Sprintf("e%d", i)))
		}
		return ms
	}
	ds := p.ProcessRun(ctx, batch(0, 10), consumer.RunLimits{})
	require.Len(t, ds, 10)
	for _, d := range ds {
		require.Equal(t, inbox.Executed, d.Outcome.Disposition)
	}
	// The rows go behind the ledger's back: only Redis can answer now.
	pg.Exec(t, `DELETE FROM processed_events`)
	ds = p.ProcessRun(ctx, batch(0, 12), consumer.RunLimits{})
	require.Len(t, ds, 12)
	for i, d := range ds {
		want := inbox.Duplicate
		if i >= 10 {
			want = inbox.Executed
		}
		require.Equal(t, want, d.Outcome.Disposition, i)
	}
	require.EqualValues(t, 10, cached.Load(), "duplicates answered from Redis")
	require.EqualValues(t, 12, f.runs.Load())
	require.Equal(t, 2, pg.Count(t, `SELECT count(*) FROM processed_events`), "no claim for the cached ones")
}
