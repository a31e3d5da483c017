package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// TestObserveRunsEveryMessage: an observe-mode processor runs duplicates,
// messages without an ID and a failing message's retries as the
// at-least-once consumer would, while the ledger records each ID under
// the observe scope and the hook says what dedupe would have done.
func TestObserveRunsEveryMessage(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := context.Background()
	var mu sync.Mutex
	var would []string
	cfg := f.cfg()
	cfg.Observe = true
	cfg.Hooks.OnObserve = func(_ *consumer.Message, w string) {
		mu.Lock()
		defer mu.Unlock()
		would = append(would, w)
	}
	p, err := consumer.New(cfg, f.insert)
	require.NoError(t, err)

	for _, id := range []string{"a", "a", "b", "a"} {
		d := p.Process(ctx, msg(id))
		require.Equal(t, consumer.Ack, d.Action)
		require.True(t, d.HandlerRan)
	}
	d := p.Process(ctx, msg(""))
	require.Equal(t, consumer.Ack, d.Action, "no ID: run, not dead-lettered")
	require.EqualValues(t, 5, f.runs.Load(), "every message ran")
	require.Empty(t, f.dead)
	require.Equal(t, []string{consumer.WouldRun, consumer.WouldSkip, consumer.WouldRun, consumer.WouldSkip,
		consumer.WouldRefuseMissingKey}, would)

	// The IDs are recorded under the observe scope only.
	require.Equal(t, 2, f.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'test~observe'`))
	require.Equal(t, 0, f.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'test'`))
	require.Equal(t, 5, f.pg.Count(t, `SELECT count(*) FROM effects`))

	// An enforcing processor of the same scope starts from no IDs.
	enf, err := consumer.New(f.cfg(), f.insert)
	require.NoError(t, err)
	d = enf.Process(ctx, msg("a"))
	require.Equal(t, inbox.Executed, d.Outcome.Disposition)

	// A failing handler is retried and dead-lettered as when enforcing,
	// and its failure recorded under the observe scope.
	fail, err := consumer.New(cfg, func(context.Context, pgx.Tx, *consumer.Message) error { return errors.New("boom") })
	require.NoError(t, err)
	d = fail.ProcessWithRetry(ctx, msg("c"), nil)
	require.True(t, d.DeadLettered)
	require.Equal(t, 1, f.pg.Count(t, `SELECT count(*) FROM processed_events WHERE scope = 'test~observe' AND event_id = 'c' AND status = 'failed'`))

	// Batches run message by message.
	ds := p.ProcessBatch(ctx, []*consumer.Message{msg("a"), msg("d"), msg("d")})
	for _, d := range ds {
		require.Equal(t, consumer.Ack, d.Action)
	}
	require.EqualValues(t, 9, f.runs.Load())
}
