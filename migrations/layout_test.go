package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/migrations"
)

// The default bucket width is MaxTTL/DefaultBucketsPerTTL, rounded down to
// whole seconds (a MaxTTL that does not divide evenly is accepted).
func TestTimeBucketDefaultWidth(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		maxTTL, width time.Duration
	}{
		{0, migrations.DefaultMaxTTL / migrations.DefaultBucketsPerTTL}, // 24 h: 4 h
		{10 * time.Second, time.Second},                                 // 1.67 s: 1 s
		{3 * time.Second, time.Second},                                  // 0.5 s: 1 s
	} {
		t.Run(c.maxTTL.String(), func(t *testing.T) {
			t.Parallel()
			pg := testsvc.Postgres(t, testsvc.NoMigrate())
			ctx := context.Background()
			_, err := migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema, Layout: migrations.LayoutTimeBuckets, MaxTTL: c.maxTTL}).Up(ctx)
			require.NoError(t, err)
			var width, maxTTL time.Duration
			require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT width, max_ttl FROM processed_events_layout`).Scan(&width, &maxTTL))
			require.Equal(t, c.width, width)
			if c.maxTTL != 0 {
				require.Equal(t, c.maxTTL, maxTTL)
			}
		})
	}
}
