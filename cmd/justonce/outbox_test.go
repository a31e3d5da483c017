package main

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/outbox"
)

// The outbox commands against a migrated schema: stats, failed, retry and
// purge, in text and in the documented JSON, with their usage errors.
func TestOutboxCommands(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t)
	env := map[string]string{"DATABASE_URL": pg.URL, "JUSTONCE_SCHEMA": pg.Schema}
	cli := func(args ...string) (int, string, string) {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), args, &stdout, &stderr, func(k string) string { return env[k] })
		return code, stdout.String(), stderr.String()
	}
	must := func(args ...string) string {
		code, out, errOut := cli(args...)
		require.Equal(t, exitOK, code, "justonce %v\n%s%s", args, out, errOut)
		return out
	}
	asJSON := func(v any, args ...string) {
		out := must(append(args, "--json")...)
		checkJSON(t, args[0]+" "+args[1], out)
		require.NoError(t, json.Unmarshal([]byte(out), v), out)
	}

	out := must("outbox", "stats")
	require.Contains(t, out, "pending: 0 messages in 0 lanes")
	require.Contains(t, out, "failed: 0 messages")
	var st outboxStatsJSON
	asJSON(&st, "outbox", "stats")
	require.Zero(t, st.Pending)
	require.Nil(t, st.OldestPendingAt)
	require.Nil(t, st.OldestPendingAgeSeconds)

	ob, err := outbox.New(pg.Pool, outbox.Config{Schema: pg.Schema})
	require.NoError(t, err)
	var ids []string
	require.NoError(t, pgx.BeginFunc(context.Background(), pg.Pool, func(tx pgx.Tx) error {
		ids, err = ob.Add(context.Background(), tx,
			outbox.Message{Broker: outbox.Kafka, Topic: "orders", Key: []byte("a"), Value: []byte("1")},
			outbox.Message{Broker: outbox.Kafka, Topic: "orders", Key: []byte("b"), Value: []byte("2")},
			outbox.Message{Broker: outbox.NATS, Topic: "payments", Value: []byte("3")})
		return err
	}))
	// Two refused by their broker, as a relay marks them.
	// They were added two days before they failed.
	pg.Exec(t, `UPDATE outbox SET status = 'failed', error = 'Message Size Too Large', attempts = 1, failed_at = now(),
		created_at = now() - interval '2 days' WHERE id = ANY($1)`, ids[:2])

	out = must("outbox", "stats")
	require.Contains(t, out, "pending: 1 message in 1 lane")
	require.Contains(t, out, "failed: 2 messages")
	require.Contains(t, out, "justonce outbox retry --all")
	asJSON(&st, "outbox", "stats")
	require.Equal(t, int64(1), st.Pending)
	require.Equal(t, int64(2), st.Failed)
	require.NotNil(t, st.OldestPendingAgeSeconds)
	require.NotNil(t, st.OldestFailedAt)
	require.WithinDuration(t, time.Now(), *st.OldestFailedAt, time.Minute, "when the oldest failure happened, not when its message was added")

	out = must("outbox", "failed")
	require.Contains(t, out, ids[0])
	require.Contains(t, out, "Message Size Too Large")
	var failed outboxFailedJSON
	asJSON(&failed, "outbox", "failed", "--limit", "1")
	require.Len(t, failed.Messages, 1)
	require.Equal(t, ids[0], failed.Messages[0].ID)
	require.Equal(t, "kafka", failed.Messages[0].Broker)

	code, _, errOut := cli("outbox", "retry")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "--all")
	code, _, _ = cli("outbox", "retry", ids[0], "--all")
	require.Equal(t, exitUsage, code)
	var retried outboxRetryJSON
	asJSON(&retried, "outbox", "retry", ids[0])
	require.Equal(t, int64(1), retried.Retried)

	code, _, errOut = cli("outbox", "purge")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "--failed")
	// Purging every failed message takes --all, as retry does.
	code, _, errOut = cli("outbox", "purge", "--failed")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "--all")
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM outbox WHERE status = 'failed'`), "nothing purged")
	code, _, _ = cli("outbox", "purge", "--failed", "--all", ids[1])
	require.Equal(t, exitUsage, code)
	out = must("outbox", "purge", "--failed", "--all", "--older-than", "1h")
	require.Contains(t, out, "deleted 0 failed messages")
	var purged outboxPurgeJSON
	asJSON(&purged, "outbox", "purge", "--failed", "--all")
	require.Equal(t, int64(1), purged.Deleted)
	require.Equal(t, 2, pg.Count(t, `SELECT count(*) FROM outbox WHERE status = 'pending'`), "pending messages stay")

	// An unmigrated schema: an operational error with the hint.
	env["JUSTONCE_SCHEMA"] = pg.Schema + "_none"
	code, _, errOut = cli("outbox", "stats")
	require.Equal(t, exitFailure, code)
	require.Contains(t, errOut, "justonce migrate up")
}
