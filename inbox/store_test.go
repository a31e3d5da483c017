package inbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// The ledger's look-ups read every column the migrations declare but the
// key's (and, on the time-bucket layout, the bucket's), in the table's
// order, and the result's clock of migration 6, through which they mask a
// result past it: a column added to 001_processed_events.up.sql and not to
// the stores' column list fails it.
func TestLookupReadsEveryColumn(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b := setupLayout(t, mc, inbox.Config{})
		rows, err := b.pg.Pool.Query(context.Background(), `SELECT column_name::text FROM information_schema.columns
			WHERE table_schema = $1 AND table_name = 'processed_events' ORDER BY ordinal_position`, b.pg.Schema)
		require.NoError(t, err)
		cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		want := append(append([]string{"scope", "tenant", "event_id"}, inbox.RowColumns()...), "result_expires_at")
		if mc.Layout == migrations.LayoutTimeBuckets {
			want = append(want, "bucket")
		}
		require.Equal(t, want, cols)
	})
}
