package httpretry

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
)

func TestTransportBackoffSchedule(t *testing.T) {
	t.Parallel()
	tr := &Transport{}
	for n, hi := range map[int]time.Duration{1: 100, 2: 200, 3: 400} {
		hi *= time.Millisecond
		for i := 0; i < 200; i++ {
			d := tr.delay(n)
			require.GreaterOrEqual(t, d, hi/2, "retry %d", n)
			require.LessOrEqual(t, d, hi, "retry %d", n)
		}
	}
	capped := &Transport{Backoff: backoff.Backoff{Initial: time.Second, Max: 3 * time.Second}}
	require.LessOrEqual(t, capped.delay(10), 3*time.Second)
	require.GreaterOrEqual(t, capped.delay(10), 1500*time.Millisecond)
}

// The client's default Max is 5 s, not the runtime's 30 s: the waits of a
// zero Backoff stop growing there, and a Retry-After is cut to it.
func TestTransportDefaultBackoffMax(t *testing.T) {
	t.Parallel()
	require.Equal(t, 5*time.Second, DefaultBackoffMax)
	tr := &Transport{}
	require.Equal(t, DefaultBackoffMax, tr.policy().Max)
	for i := 0; i < 200; i++ {
		d := tr.delay(40)
		require.GreaterOrEqual(t, d, DefaultBackoffMax/2)
		require.LessOrEqual(t, d, DefaultBackoffMax)
	}
	// A Max of its own is kept; Initial and Multiplier keep their defaults.
	own := &Transport{Backoff: backoff.Backoff{Max: time.Minute}}
	require.Equal(t, backoff.Backoff{Max: time.Minute}, own.policy())
	require.Greater(t, own.delay(40), DefaultBackoffMax)
}

func TestRetryAfterParsing(t *testing.T) {
	t.Parallel()
	d, ok := retryAfter("3")
	require.True(t, ok)
	require.Equal(t, 3*time.Second, d)
	d, ok = retryAfter(time.Now().Add(time.Hour).UTC().Format(http.TimeFormat))
	require.True(t, ok)
	require.Greater(t, d, 59*time.Minute)
	for _, v := range []string{"", "-1", "soon"} {
		_, ok := retryAfter(v)
		require.False(t, ok, v)
	}
}
