package inbox_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// TestMeasureResultClockChurn measures what the result's own clock costs
// the database: for N keys with a 1 KiB stored response, on both layouts,
// with one clock (the result lives as long as the key) and two (the result
// goes first), the WAL the ledger's relations get (from pg_walinspect,
// filtered by their files, so that other sessions' WAL is not counted) and
// the row versions made dead (heap UPDATE, HOT_UPDATE and DELETE records),
// in three phases: the writes, the janitor's pass once the results' clock
// passed, the janitor's passes once the keys expired. It is a measurement,
// not a check: run it with
//
//	JUSTONCE_MEASURE_CHURN=1 go test -count=1 -v -run TestMeasureResultClockChurn ./inbox
//
// (JUSTONCE_MEASURE_KEYS sets N, default 1000). The database role must be
// allowed to create the pg_walinspect extension (it is created in the
// test's schema, and dropped at the end).
func TestMeasureResultClockChurn(t *testing.T) {
	if os.Getenv("JUSTONCE_MEASURE_CHURN") == "" {
		t.Skip("a measurement: set JUSTONCE_MEASURE_CHURN=1")
	}
	n := envInt("JUSTONCE_MEASURE_KEYS", 1000)
	body := []byte(strings.Repeat("x", 1024))
	type phase struct{ wal, dead, fpi int64 }
	fmt.Printf("%-8s %-10s %-12s %12s %12s %12s\n", "layout", "clocks", "phase", "WAL B/key", "FPI B/key", "dead/key")
	walSchema := ""
	for _, lay := range layouts {
		for _, two := range []bool{false, true} {
			mc := lay.cfg
			if mc.Layout == migrations.LayoutTimeBuckets {
				mc.BucketWidth, mc.MaxTTL = 2*time.Second, 10*time.Second
			}
			pg := testsvc.Postgres(t, testsvc.NoMigrate())
			mc.Schema = pg.Schema
			ctx := context.Background()
			_, err := migrations.New(pg.Pool, mc).Up(ctx)
			require.NoError(t, err)
			if walSchema == "" {
				// pg_walinspect, once per database, in a schema of the
				// measurement's own, dropped at the end.
				walSchema = pg.Schema + "_wal"
				pg.Exec(t, `CREATE SCHEMA `+pgx.Identifier{walSchema}.Sanitize())
				pg.Exec(t, `CREATE EXTENSION pg_walinspect SCHEMA `+pgx.Identifier{walSchema}.Sanitize())
				t.Cleanup(func() {
					_, _ = pg.Pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{walSchema}.Sanitize()+` CASCADE`)
				})
			}
			// A temporary replication slot, held by a session of its own,
			// keeps the server's WAL from being recycled while it is read
			// (it goes with the session).
			slot, err := pg.Pool.Acquire(ctx)
			require.NoError(t, err)
			_, err = slot.Exec(ctx, `SELECT pg_create_physical_replication_slot($1, true, true)`, "justonce_churn_"+pg.Schema)
			require.NoError(t, err)
			t.Cleanup(func() { _ = slot.Conn().Close(context.Background()); slot.Release() })
			l, err := inbox.New(pg.Pool, inbox.Config{DefaultTTL: 10 * time.Second})
			require.NoError(t, err)
			resultTTL := time.Duration(0)
			if two {
				resultTTL = time.Second
			}
			// files are the file nodes of the ledger's relations (tables,
			// buckets, their TOAST and indexes), as a regular expression
			// on pg_walinspect's block references.
			files := map[string]bool{}
			addFiles := func() {
				rows, err := pg.Pool.Query(ctx, `SELECT pg_relation_filenode(c.oid)::text FROM pg_class c
					WHERE (c.relnamespace = $1::regnamespace OR c.oid IN (
						SELECT t.reltoastrelid FROM pg_class t WHERE t.relnamespace = $1::regnamespace
						UNION SELECT i.indexrelid FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid
							WHERE t.relnamespace IN (SELECT oid FROM pg_namespace WHERE nspname = 'pg_toast')
							AND t.oid IN (SELECT reltoastrelid FROM pg_class WHERE relnamespace = $1::regnamespace)))
						AND pg_relation_filenode(c.oid) IS NOT NULL`, pg.Schema)
				require.NoError(t, err)
				names, err := pgx.CollectRows(rows, pgx.RowTo[string])
				require.NoError(t, err)
				for _, f := range names {
					files[f] = true
				}
			}
			lsn := func() string {
				var s string
				require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&s))
				return s
			}
			measure := func(from string, run func()) phase {
				addFiles()
				run()
				addFiles()
				var keys []string
				for f := range files {
					keys = append(keys, f)
				}
				re := `rel [0-9]+/[0-9]+/(` + strings.Join(keys, "|") + `) `
				var p phase
				require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT coalesce(sum(record_length), 0), coalesce(sum(fpi_length), 0),
					count(*) FILTER (WHERE resource_manager = 'Heap' AND record_type IN ('UPDATE', 'HOT_UPDATE', 'DELETE'))
					FROM `+pgx.Identifier{walSchema}.Sanitize()+`.pg_get_wal_records_info_till_end_of_wal($1::pg_lsn)
					WHERE block_ref ~ $2`,
					from, re).Scan(&p.wal, &p.fpi, &p.dead))
				return p
			}
			show := func(name string, p phase) {
				clocks := "one"
				if two {
					clocks = "two"
				}
				fmt.Printf("%-8s %-10s %-12s %12.0f %12.0f %12.2f\n", lay.name, clocks, name,
					float64(p.wal)/float64(n), float64(p.fpi)/float64(n), float64(p.dead)/float64(n))
			}
			var total phase
			add := func(p phase) { total.wal += p.wal; total.fpi += p.fpi; total.dead += p.dead }
			pg.Exec(t, `CHECKPOINT`)

			p := measure(lsn(), func() {
				for i := range n {
					r := inbox.Request{Key: inbox.Key{Scope: "churn", ID: fmt.Sprintf("k-%d", i)}, ResultTTL: resultTTL}
					_, err := l.Do(ctx, r, func(context.Context, pgx.Tx) (inbox.Result, error) {
						return inbox.Result{Code: 201, Body: body}, nil
					})
					require.NoError(t, err)
				}
			})
			show("writes", p)
			add(p)

			// The results' clock passes (the keys live on): one pass.
			var keysExpire time.Time
			require.NoError(t, pg.Pool.QueryRow(ctx, `SELECT max(expires_at) FROM processed_events`).Scan(&keysExpire))
			testsvc.Eventually(t, 10*time.Second, func() bool {
				return !two || pg.Count(t, `SELECT count(*) FROM processed_events WHERE result_expires_at > now()`) == 0
			}, "results expired")
			p = measure(lsn(), func() {
				_, err := l.Purge(ctx, inbox.JanitorConfig{})
				require.NoError(t, err)
			})
			if two {
				require.Zero(t, pg.Count(t, `SELECT count(*) FROM processed_events WHERE response_body IS NOT NULL`))
			}
			show("clear", p)
			add(p)

			// The keys expire: the janitor's passes until every row is gone.
			p = measure(lsn(), func() {
				testsvc.Eventually(t, time.Minute, func() bool {
					_, err := l.Purge(ctx, inbox.JanitorConfig{})
					require.NoError(t, err)
					return time.Now().After(keysExpire) && pg.Count(t, `SELECT count(*) FROM processed_events`) == 0
				}, "rows purged")
			})
			show("purge", p)
			add(p)
			show("total", total)
		}
	}
}
