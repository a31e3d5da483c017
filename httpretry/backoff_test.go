package httpretry

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
	capped := &Transport{Backoff: Backoff{Initial: time.Second, Max: 3 * time.Second}}
	require.LessOrEqual(t, capped.delay(10), 3*time.Second)
	require.GreaterOrEqual(t, capped.delay(10), 1500*time.Millisecond)
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
