package grpcretry

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/justonce/justonce/backoff"
)

func retryInfo(t *testing.T, d time.Duration) error {
	t.Helper()
	st, err := status.New(codes.Unavailable, "down").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
	require.NoError(t, err)
	return st.Err()
}

// The client's default Max is 5 s, not the runtime's 30 s: the waits of a
// zero Backoff stop growing there, and a RetryInfo delay is cut to it.
func TestDefaultBackoffMax(t *testing.T) {
	require.Equal(t, 5*time.Second, DefaultBackoffMax)
	cfg := Config{}.withDefaults()
	require.Equal(t, backoff.Backoff{Max: DefaultBackoffMax}, cfg.Backoff)
	plain := status.Error(codes.Unavailable, "down")
	for n, hi := range map[int]time.Duration{1: 100 * time.Millisecond, 2: 200 * time.Millisecond, 40: DefaultBackoffMax} {
		for i := 0; i < 200; i++ {
			d := cfg.wait(n, plain)
			require.GreaterOrEqual(t, d, hi/2, "retry %d", n)
			require.LessOrEqual(t, d, hi, "retry %d", n)
		}
	}
	require.Equal(t, DefaultBackoffMax, cfg.wait(1, retryInfo(t, time.Hour)), "RetryInfo is honoured up to Max")
	require.Equal(t, 10*time.Millisecond, cfg.wait(1, retryInfo(t, 10*time.Millisecond)))

	own := Config{Backoff: backoff.Backoff{Max: time.Minute, Multiplier: 3}}.withDefaults()
	require.Equal(t, time.Minute, own.wait(1, retryInfo(t, time.Hour)))
	for i := 0; i < 200; i++ {
		d := own.wait(2, plain)
		require.True(t, d >= 150*time.Millisecond && d <= 300*time.Millisecond, "Multiplier is honoured: %v", d)
	}
}
