package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// TestReadOnlyConnectionIsDropped: a pooled connection whose server
// refuses writes (SQLSTATE 25006: a standby, or a primary fenced read-only
// after a failover; here the session is made read-only) fails the call
// with a transient error, and is closed rather than handed back to the
// pool, so the next call runs on a new connection. With the pool's only
// connection kept, every later call would fail the same way. Do (the
// handler's write refused, or the ledger's row at COMMIT), DoBatch and
// DoEach.
func TestReadOnlyConnectionIsDropped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	b := setup(t, inbox.Config{}, testsvc.MaxConns(1))
	write := func(id string) inbox.TxFunc {
		return func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, 1)`, id)
			return inbox.Result{}, err
		}
	}
	readOnly := func() uint32 {
		t.Helper()
		b.pg.Exec(t, `SET default_transaction_read_only = on`) // on the pool's only connection
		var pid uint32
		require.NoError(t, b.pg.Pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
		return pid
	}
	requireRefused := func(err error, pid uint32) {
		t.Helper()
		var pgErr *pgconn.PgError
		require.True(t, errors.As(err, &pgErr), "%v", err)
		require.Equal(t, "25006", pgErr.Code)
		require.True(t, inbox.IsTransient(err))
		var now uint32
		require.NoError(t, b.pg.Pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&now))
		require.NotEqual(t, pid, now, "the read-only connection was closed")
		var ro string
		require.NoError(t, b.pg.Pool.QueryRow(ctx, `SHOW default_transaction_read_only`).Scan(&ro))
		require.Equal(t, "off", ro)
	}

	// Do: the handler's write refused.
	pid := readOnly()
	_, err := b.ledger.Do(ctx, req("ro", "a"), write("a"))
	requireRefused(err, pid)
	out, err := b.ledger.Do(ctx, req("ro", "a"), write("a"))
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)

	// Do: the handler writes nothing; the ledger's row is refused.
	pid = readOnly()
	none := func(context.Context, pgx.Tx) (inbox.Result, error) { return inbox.Result{}, nil }
	_, err = b.ledger.Do(ctx, req("ro", "b"), none)
	requireRefused(err, pid)
	out, err = b.ledger.Do(ctx, req("ro", "b"), none)
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)

	// DoBatch.
	batch := func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ('batch', 1)`)
		return nil, err
	}
	pid = readOnly()
	_, err = b.ledger.DoBatch(ctx, []inbox.Request{req("ro", "c")}, batch)
	requireRefused(err, pid)
	outs, err := b.ledger.DoBatch(ctx, []inbox.Request{req("ro", "c")}, batch)
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, outs[0].Disposition)

	// DoEach: its claims only lock and read, so the handler's write is the
	// first refused: the request fails.
	each := func(ctx context.Context, tx pgx.Tx, i int) (inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ('each', 1)`)
		return inbox.Result{}, err
	}
	pid = readOnly()
	run, err := b.ledger.DoEach(ctx, []inbox.Request{req("ro", "d")}, inbox.EachOptions{}, each)
	require.NoError(t, err)
	require.Len(t, run.Outcomes, 1)
	requireRefused(run.Failed, pid)
	run, err = b.ledger.DoEach(ctx, []inbox.Request{req("ro", "d")}, inbox.EachOptions{}, each)
	require.NoError(t, err)
	require.NoError(t, run.Failed)
	require.Equal(t, inbox.Executed, run.Outcomes[0].Disposition)

	// DoEach: the handlers write nothing; the rows, written with the
	// commit, are refused.
	eachNone := func(context.Context, pgx.Tx, int) (inbox.Result, error) { return inbox.Result{}, nil }
	pid = readOnly()
	_, err = b.ledger.DoEach(ctx, []inbox.Request{req("ro", "e"), req("ro", "f")}, inbox.EachOptions{}, eachNone)
	requireRefused(err, pid)
	run, err = b.ledger.DoEach(ctx, []inbox.Request{req("ro", "e"), req("ro", "f")}, inbox.EachOptions{}, eachNone)
	require.NoError(t, err)
	require.NoError(t, run.Failed)
	require.Equal(t, inbox.Executed, run.Outcomes[1].Disposition)
	require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM payments`))
}

// TestRedisRecoveriesCounted: RedisRecoveries rises once when Redis
// answers again after an outage (one episode of failed calls), not while
// it answers, nor while it is down; RedisFallbacks rises during the outage
// only.
func TestRedisRecoveriesCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	rp := testsvc.StartRedis(t)
	client := testsvc.NewRedisClient(rp.Addr)
	t.Cleanup(func() { _ = client.Close() })
	b := setup(t, inbox.Config{Redis: &inbox.RedisConfig{Client: client, Timeout: time.Second}})
	do := func(id string) inbox.Outcome {
		t.Helper()
		out, err := b.ledger.Do(ctx, req("recover", id), func(context.Context, pgx.Tx) (inbox.Result, error) {
			return inbox.Result{Code: 200}, nil
		})
		require.NoError(t, err)
		return out
	}
	for i := 0; i < 5; i++ {
		do(fmt.Sprint("up-", i))
	}
	c := b.ledger.Counters()
	require.Zero(t, c.RedisFallbacks)
	require.Zero(t, c.RedisRecoveries, "nothing to recover from")

	rp.Stop(t)
	for i := 0; i < 5; i++ {
		require.Equal(t, inbox.Executed, do(fmt.Sprint("down-", i)).Disposition)
	}
	c = b.ledger.Counters()
	require.Positive(t, c.RedisFallbacks)
	require.Zero(t, c.RedisRecoveries, "still down")

	rp.Start(t)
	// The pool's connections died with the server: the first calls may
	// fail on them before one answers.
	testsvc.Eventually(t, 10*time.Second, func() bool { return do("back").Cached }, "answered from Redis again")
	c = b.ledger.Counters()
	require.EqualValues(t, 1, c.RedisRecoveries, "one episode ended")
	for i := 0; i < 5; i++ {
		do(fmt.Sprint("up-again-", i))
	}
	after := b.ledger.Counters()
	require.Equal(t, c.RedisFallbacks, after.RedisFallbacks, "no fallback once Redis answers")
	require.EqualValues(t, 1, after.RedisRecoveries)
}

// A start-up check for a service whose database has a standby that a
// failover promotes: the ledger's commits must be on a synchronous standby
// before they are acknowledged, or a failover can lose events the ledger
// reported done. The tests' Postgres has no standby.
func ExampleLedger_CheckReplication() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	rep, err := ledger.CheckReplication(ctx)
	switch {
	case errors.Is(err, inbox.ErrNotReplicated): // refuse to start, or warn
		fmt.Println(err)
		fmt.Println("standbys:", rep.Standbys, "synchronous_commit:", rep.SynchronousCommit)
	case err != nil: // the query failed
		log.Fatal(err)
	default:
		fmt.Println("commits wait for", rep.SynchronousStandbyNames)
	}
	// Output:
	// justonce/inbox: commits are acknowledged before a standby has them: no standby streams from the server and none is waited for
	// standbys: 0 synchronous_commit: on
}
