package horizon

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestKafka(t *testing.T) {
	t.Parallel()
	const ttl = 24 * time.Hour
	for _, tc := range []struct {
		name      string
		configs   map[string]string
		retention time.Duration
		unbounded bool
		basis     string
		err       string
	}{
		{"delete", map[string]string{"cleanup.policy": "delete", "retention.ms": "3600000", "segment.ms": "600000", "retention.bytes": "-1"},
			70 * time.Minute, false, "retention.ms 1h0m0s + segment.ms 10m0s", ""},
		{"retention.bytes is not time", map[string]string{"retention.ms": "3600000", "segment.ms": "600000", "retention.bytes": "1048576"},
			70 * time.Minute, false, "retention.bytes 1048576 also deletes by size, not time", ""},
		{"no time limit", map[string]string{"retention.ms": "-1", "segment.ms": "600000"}, 0, true, "retention.ms -1: no time limit", ""},
		{"compacted", map[string]string{"cleanup.policy": "compact", "retention.ms": "3600000"}, 0, true, "cleanup.policy compact", ""},
		{"compacted and deleted", map[string]string{"cleanup.policy": "compact, delete", "retention.ms": "3600000", "segment.ms": "0"},
			time.Hour, false, "retention.ms 1h0m0s", ""},
		{"Long.MAX_VALUE", map[string]string{"retention.ms": "9223372036854775807", "segment.ms": "600000"}, 0, true, "no time limit", ""},
		{"no retention.ms", map[string]string{"segment.ms": "600000"}, 0, false, "", "did not give its retention.ms"},
		{"garbage", map[string]string{"retention.ms": "soon", "segment.ms": "600000"}, 0, false, "", `retention.ms "soon"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := Kafka("orders", tc.configs, ttl)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, "orders", h.Topic)
			require.Equal(t, ttl, h.TTL)
			require.Equal(t, tc.unbounded, h.Unbounded)
			if !tc.unbounded {
				require.Equal(t, tc.retention, h.Retention)
			}
			require.Contains(t, h.Basis, tc.basis)
			require.Equal(t, int64(-1), h.Behind)
			require.Equal(t, int64(-1), h.Stale)
		})
	}
}

func TestLag(t *testing.T) {
	t.Parallel()
	parts := []Partition{
		{Start: 0, End: 10, Committed: 4, Fresh: 6},   // 6 behind, 2 of them old
		{Start: 5, End: 9, Committed: -1, Fresh: -1},  // no offset: 4 behind, all old
		{Start: 20, End: 30, Committed: 3, Fresh: 25}, // committed below the log start: from 20
		{Start: 0, End: 7, Committed: 7, Fresh: 0},    // caught up
	}
	behind, stale := Lag(parts, false)
	require.Equal(t, int64(6+4+10), behind)
	require.Equal(t, int64(2+4+5), stale)
	behind, stale = Lag(parts, true)
	require.Equal(t, int64(6), behind, "partitions without a usable offset are read from their end")
	require.Equal(t, int64(2), stale)
}
