package outboxtest

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest/testproc"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
)

// The relay process's environment: which Target, and where.
const (
	envRelay  = "JUSTONCE_OUTBOXTEST_RELAY" // the Target's Name
	envPG     = "JUSTONCE_OUTBOXTEST_PG"
	envSchema = "JUSTONCE_OUTBOXTEST_SCHEMA"
	envAddr   = "JUSTONCE_OUTBOXTEST_ADDR"
	envApp    = "JUSTONCE_OUTBOXTEST_APP"
)

// RelayChild makes the test binary the relay process KilledRelay starts
// for tg: when this process is that relay, it runs the relay over tg's
// publisher until SIGTERM (or three minutes) and exits; otherwise it
// returns at once. Call it from an init function of the test package that
// calls KilledRelay with tg (init runs before TestMain and the tests).
func RelayChild(tg Target) {
	if os.Getenv(envRelay) != tg.Name {
		return
	}
	if err := relayProcess(tg); err != nil {
		fmt.Fprintln(os.Stderr, "relay process:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func relayProcess(tg Target) error {
	ctx, cancel := testproc.Context(3 * time.Minute)
	defer cancel()
	cfg, err := pgxpool.ParseConfig(os.Getenv(envPG))
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = os.Getenv(envApp)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ob, err := outbox.New(pool, outbox.Config{Schema: os.Getenv(envSchema), Lanes: 8, Logger: log})
	if err != nil {
		return err
	}
	p, closeAll, err := tg.Publisher(os.Getenv(envAddr))
	if err != nil {
		return err
	}
	defer closeAll()
	r, err := ob.Relay(outbox.RelayConfig{Publishers: map[outbox.Broker]outbox.Publisher{tg.Broker: p},
		BatchSize: 50, Concurrency: 4, PollInterval: 100 * time.Millisecond})
	if err != nil {
		return err
	}
	return r.Run(ctx)
}

// KilledRelay: a relay process (the test binary, see RelayChild) over
// tg's publisher is SIGKILLed mid-batch three times, each time with
// batches the broker acked and whose deletion it had not committed. The
// next relay publishes those batches again, and they are the only
// repeats; none is lost; each key's first deliveries are in order; and a
// consumer of tg's front downstream runs every message's effect once,
// answering the repeats as duplicates.
func KilledRelay(t *testing.T, tg Target) {
	t.Parallel()
	fx := newFixture(t, tg, 8)
	dest := tg.Destination(t, fx.addr, 4)
	fx.pg.Exec(t, `CREATE TABLE effects (event_id text NOT NULL, value bytea)`)
	const keys, perKey = 20, 200
	const total = keys * perKey
	for i := range perKey {
		var msgs []outbox.Message
		for k := range keys {
			key := "key-" + strconv.Itoa(k)
			msgs = append(msgs, outbox.Message{Broker: tg.Broker, Topic: tg.Topic(dest, key), Key: []byte(key), Value: []byte(strconv.Itoa(i))})
		}
		fx.add(t, msgs...)
	}
	app := "relay-" + fx.pg.Schema
	start := func(round int) *testproc.Proc {
		return testproc.Start(t, "relay process "+strconv.Itoa(round),
			[]string{envRelay + "=" + tg.Name, envPG + "=" + fx.pg.URL, envSchema + "=" + fx.pg.Schema, envAddr + "=" + fx.addr, envApp + "=" + app},
			testproc.RunNone)
	}

	inFlight := map[string]bool{} // published and not deleted when a relay died
	const kills = 3
	for round := range kills {
		before := fx.pending(t)
		p := start(round)
		target := before - 300
		testsvc.Eventually(t, 90*time.Second, func() bool { return fx.pending(t) <= target }, "round %d: progress", round)
		// Hold the relay's next deletions: lock every pending row. Its
		// batches are read and published, their DELETE waits.
		lockTx, err := fx.pg.Pool.Begin(context.Background())
		require.NoError(t, err)
		_, err = lockTx.Exec(context.Background(), `SELECT 1 FROM outbox WHERE status = 'pending' FOR UPDATE`)
		require.NoError(t, err)
		testsvc.Eventually(t, 60*time.Second, func() bool {
			return fx.pg.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, app) >= 1
		}, "round %d: a batch published and waiting to be deleted", round)
		p.Kill(t)
		require.NoError(t, lockTx.Rollback(context.Background()))

		// What the broker has that the outbox still holds: the killed
		// batches.
		published := map[string]bool{}
		for _, m := range tg.Read(t, fx.addr, dest) {
			published[m.ID] = true
		}
		rows, err := fx.pg.Pool.Query(context.Background(), `SELECT id FROM outbox`)
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		n := 0
		for _, id := range ids {
			if published[id] {
				inFlight[id] = true
				n++
			}
		}
		require.Positive(t, n, "round %d: the killed relay had a batch in flight", round)
		t.Logf("round %d: killed with %d messages published and not deleted, %d pending", round, n, fx.pending(t))
	}
	p := start(kills)
	fx.waitDrained(t, 120*time.Second)
	require.NoError(t, p.Stop(time.Minute), "graceful stop")

	// The broker: every message at least once; the repeats are the killed
	// batches'; per key, first deliveries in order.
	seen := map[string]int{}
	next := map[string]int{}
	for _, m := range tg.Read(t, fx.addr, dest) {
		seen[m.ID]++
		if seen[m.ID] > 1 {
			require.True(t, inFlight[m.ID], "%s published twice but was not in a killed batch", m.ID)
			continue
		}
		v, _ := strconv.Atoi(string(m.Value))
		require.Equal(t, next[m.Order], v, "%s out of order", m.Order)
		next[m.Order]++
	}
	require.Len(t, seen, total, "0 lost")
	dups := 0
	for _, c := range seen {
		dups += c - 1
	}
	require.Positive(t, dups, "the killed batches were published again")

	// Downstream: a justonce consumer runs each message's effect once.
	ledger, err := inbox.New(fx.pg.Pool, inbox.Config{})
	require.NoError(t, err)
	var mu sync.Mutex
	outcomes := map[inbox.Disposition]int{}
	c := tg.Consumer(t, fx.addr, dest, "g-"+dest, consumer.Config{Ledger: ledger, Hooks: consumer.Hooks{
		OnOutcome: func(_ *consumer.Message, o inbox.Outcome, _ time.Duration) {
			mu.Lock()
			outcomes[o.Disposition]++
			mu.Unlock()
		}}},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, m.ID, m.Value)
			return err
		})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	testsvc.Eventually(t, 120*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return outcomes[inbox.Executed]+outcomes[inbox.Duplicate] == total+dups
	}, "consumer read everything")
	cancel()
	require.NoError(t, <-done)
	require.Equal(t, total, fx.pg.Count(t, `SELECT count(*) FROM effects`), "each effect once")
	require.Equal(t, total, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))
	mu.Lock()
	require.Equal(t, dups, outcomes[inbox.Duplicate], "the repeats were answered as duplicates")
	mu.Unlock()
	t.Logf("%s: %d messages, %d published twice (all from killed batches), 0 lost, 0 effects doubled", tg.Name, total, dups)
}
