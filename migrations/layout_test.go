package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/migrations"
)

// The defaults: a bucket width of MaxTTL and DefaultShards shards, each
// with its first bucket, opened at staggered times over one width.
func TestTimeBucketDefaults(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		maxTTL, width time.Duration
	}{
		{0, migrations.DefaultMaxTTL},
		{10 * time.Second, 10 * time.Second},
	} {
		t.Run(c.maxTTL.String(), func(t *testing.T) {
			t.Parallel()
			pg := testsvc.Postgres(t, testsvc.NoMigrate())
			ctx := context.Background()
			_, err := migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema, Layout: migrations.LayoutTimeBuckets, MaxTTL: c.maxTTL}).Up(ctx)
			require.NoError(t, err)
			var width, maxTTL time.Duration
			var shards int
			require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT width, max_ttl, shards FROM processed_events_layout`).Scan(&width, &maxTTL, &shards))
			require.Equal(t, c.width, width)
			require.Equal(t, migrations.DefaultShards, shards)
			if c.maxTTL != 0 {
				require.Equal(t, c.maxTTL, maxTTL)
			}
			// One bucket per shard, opened one width/shards apart.
			var spread []float64 // seconds before the newest opening
			require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT array_agg(extract(epoch FROM m.o - b.opened_at)::float8 ORDER BY b.shard)
				FROM processed_events_buckets b, (SELECT max(opened_at) o FROM processed_events_buckets) m`).Scan(&spread))
			require.Len(t, spread, migrations.DefaultShards)
			for s, d := range spread {
				require.InDelta(t, width.Seconds()*float64(s)/float64(shards), d, 0.001, "shard %d", s)
			}
		})
	}
}
