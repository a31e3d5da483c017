package consumer_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
)

// The runtime's default Max is 30 s (the clients' is 5 s): with Backoff
// left unset, a handler failing for the 40th time is retried after 15 to
// 30 s, and a Max of the runtime's own is kept.
func TestDefaultBackoffMax(t *testing.T) {
	t.Parallel()
	require.Equal(t, 30*time.Second, consumer.DefaultBackoffMax)
	f := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := f.cfg()
	cfg.Backoff, cfg.MaxAttempts = backoff.Backoff{}, 100
	boom := errors.New("boom")
	p, err := consumer.New(cfg, func(context.Context, pgx.Tx, *consumer.Message) error { return boom })
	require.NoError(t, err)
	require.Equal(t, backoff.Backoff{Max: consumer.DefaultBackoffMax}, p.Config().Backoff)
	for i := 0; i < 20; i++ {
		m := msg("late")
		m.Attempt = 40
		d := p.Process(ctx, m)
		require.Equal(t, consumer.Retry, d.Action, "%v", d.Err)
		require.ErrorIs(t, d.Err, boom)
		require.GreaterOrEqual(t, d.Delay, consumer.DefaultBackoffMax/2)
		require.LessOrEqual(t, d.Delay, consumer.DefaultBackoffMax)
	}

	cfg.Backoff = backoff.Backoff{Max: time.Second}
	p, err = consumer.New(cfg, func(context.Context, pgx.Tx, *consumer.Message) error { return boom })
	require.NoError(t, err)
	m := msg("own-max")
	m.Attempt = 40
	require.LessOrEqual(t, p.Process(ctx, m).Delay, time.Second)
}
