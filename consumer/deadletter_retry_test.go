package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// TestDeadLetterPublishRetriedWithoutRerunningHandler: once a message is
// decided dead, a failing dead-letter publish is retried on its own, with a
// growing backoff; the handler does not run again for each try.
func TestDeadLetterPublishRetriedWithoutRerunningHandler(t *testing.T) {
	t.Parallel()
	f := setup(t)
	var publishes atomic.Int64
	var stamps []time.Time
	cfg := f.cfg()
	cfg.MaxAttempts = 1
	cfg.StoreBackoff = backoff.Backoff{Initial: 5 * time.Millisecond, Max: 40 * time.Millisecond}
	cfg.DeadLetter = func(context.Context, *consumer.Message, error) error {
		stamps = append(stamps, time.Now())
		if publishes.Add(1) <= 5 {
			return errors.New("broker down")
		}
		return nil
	}
	var runs atomic.Int64
	p, err := consumer.New(cfg, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		runs.Add(1)
		return errors.New("bad event")
	})
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := msg("evt-dl")
	d := p.Process(ctx, m)
	require.Equal(t, consumer.Ack, d.Action)
	require.True(t, d.DeadLettered)
	require.EqualValues(t, 1, runs.Load(), "the handler ran once, not once per publish try")
	require.EqualValues(t, 6, publishes.Load())
	// The waits grow: the last gap is longer than the first.
	require.Greater(t, stamps[5].Sub(stamps[4]), stamps[1].Sub(stamps[0]))
	rec, err := f.ledger.Lookup(ctx, inbox.Key{Scope: "test", ID: "evt-dl"})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusFailed, rec.Status)

	// A context that ends while the publish keeps failing stops: the
	// message is neither acked nor lost.
	publishes.Store(-1000)
	sctx, scancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer scancel()
	d = p.Process(sctx, msg("evt-dl-2"))
	require.Equal(t, consumer.Stop, d.Action)
	require.False(t, d.DeadLettered)
}
