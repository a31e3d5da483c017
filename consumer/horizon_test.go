package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

func TestHorizonHeadroom(t *testing.T) {
	t.Parallel()
	within := consumer.Horizon{Topic: "t", TTL: 24 * time.Hour, Retention: 20 * time.Hour}
	require.False(t, within.Exceeded())
	require.Equal(t, (4 * time.Hour).Seconds(), within.Headroom())
	equal := consumer.Horizon{TTL: time.Hour, Retention: time.Hour}
	require.False(t, equal.Exceeded(), "an ID is recorded at or after its message was written")
	above := consumer.Horizon{TTL: time.Hour, Retention: 3 * time.Hour}
	require.True(t, above.Exceeded())
	require.Equal(t, -(2 * time.Hour).Seconds(), above.Headroom())
	forever := consumer.Horizon{TTL: time.Hour, Unbounded: true}
	require.True(t, forever.Exceeded())
	require.True(t, math.IsInf(forever.Headroom(), -1))
	require.Equal(t, "forever", forever.RetentionString())
}

func TestHorizonError(t *testing.T) {
	t.Parallel()
	var err error = &consumer.HorizonError{Horizons: []consumer.Horizon{
		{Topic: "orders", TTL: 24 * time.Hour, Unbounded: true, Basis: "retention.ms -1: no time limit"}}}
	err = fmt.Errorf("run: %w", err)
	require.ErrorIs(t, err, consumer.ErrRedeliveryHorizon)
	require.NotErrorIs(t, err, inbox.ErrConfig)
	var he *consumer.HorizonError
	require.True(t, errors.As(err, &he))
	require.Contains(t, err.Error(), "orders keeps messages forever (retention.ms -1: no time limit), the ledger keeps their IDs 24h0m0s")
}

func TestHorizonPolicyValidated(t *testing.T) {
	t.Parallel()
	_, err := consumer.New(consumer.Config{Ledger: &inbox.Ledger{}, Scope: "s", Horizon: consumer.HorizonOff + 1},
		func(_ context.Context, _ pgx.Tx, _ *consumer.Message) error { return nil })
	require.ErrorIs(t, err, inbox.ErrConfig)
}
