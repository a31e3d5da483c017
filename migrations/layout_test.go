package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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

// tableShape is processed_events in schema as Postgres describes it: each
// column (name, type, collation, nullability, default) in order, and each
// constraint's definition by name.
func tableShape(t *testing.T, pg *testsvc.PG, schema string) (cols []string, cons map[string]string) {
	t.Helper()
	ctx := context.Background()
	rows, err := pg.Pool.Query(ctx, `SELECT format('%s %s collate=%s null=%s default=%s', column_name, data_type,
			coalesce(collation_name, '-'), is_nullable, coalesce(column_default, '-'))
		FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'processed_events'
		ORDER BY ordinal_position`, schema)
	require.NoError(t, err)
	cols, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	rows, err = pg.Pool.Query(ctx, `SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
		WHERE conrelid = (quote_ident($1) || '.processed_events')::regclass`, schema)
	require.NoError(t, err)
	cons = map[string]string{}
	var name, def string
	_, err = pgx.ForEachRow(rows, []any{&name, &def}, func() error { cons[name] = def; return nil })
	require.NoError(t, err)
	return cols, cons
}

// The time-bucket layout's table has every column of the plain one, as
// 001_processed_events.up.sql declares them (same order, types,
// collations, nullability and defaults), then the bucket; and the plain
// table's constraints, its primary key widened by the bucket. A column
// added to the migration and not to the layout's table fails it.
func TestTimeBucketTableHasThePlainColumns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	plain := testsvc.Postgres(t)
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	_, err := migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema, Layout: migrations.LayoutTimeBuckets}).Up(ctx)
	require.NoError(t, err)

	plainCols, plainCons := tableShape(t, plain, plain.Schema)
	cols, cons := tableShape(t, pg, pg.Schema)
	require.NotEmpty(t, plainCols)
	require.Equal(t, append(plainCols, "bucket integer collate=- null=NO default=-"), cols)

	require.Equal(t, "PRIMARY KEY (scope, tenant, event_id)", plainCons["processed_events_pkey"])
	delete(plainCons, "processed_events_pkey")
	plainCons["processed_events_bucket_pkey"] = "PRIMARY KEY (scope, tenant, event_id, bucket)"
	require.Equal(t, plainCons, cons)
}
