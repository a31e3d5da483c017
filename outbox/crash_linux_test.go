//go:build linux

package outbox_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

const (
	relayEnv     = "JUSTONCE_OUTBOX_RELAY_CHILD"
	relayPG      = "JUSTONCE_OUTBOX_RELAY_PG"
	relaySchema  = "JUSTONCE_OUTBOX_RELAY_SCHEMA"
	relayBrokers = "JUSTONCE_OUTBOX_RELAY_BROKERS"
	relayApp     = "JUSTONCE_OUTBOX_RELAY_APP"
)

// The test binary is the relay process TestKilledRelay starts and kills,
// when the child environment is set (see TestMain).
func init() {
	child = func() (int, bool) {
		if os.Getenv(relayEnv) != "1" {
			return 0, false
		}
		return relayProcess(), true
	}
}

// relayProcess runs a relay until SIGTERM (or three minutes).
func relayProcess() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "relay process:", err)
		return 1
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 3*time.Minute) // never outlive the test
	defer cancelTimeout()
	cfg, err := pgxpool.ParseConfig(os.Getenv(relayPG))
	if err != nil {
		return fail(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = os.Getenv(relayApp)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ob, err := outbox.New(pool, outbox.Config{Schema: os.Getenv(relaySchema), Lanes: 8, Logger: log})
	if err != nil {
		return fail(err)
	}
	w := &kafka.Writer{Addr: kafka.TCP(strings.Split(os.Getenv(relayBrokers), ",")...)}
	defer w.Close()
	r, err := ob.Relay(outbox.RelayConfig{Kafka: w, BatchSize: 50, Concurrency: 4, PollInterval: 100 * time.Millisecond})
	if err != nil {
		return fail(err)
	}
	if err := r.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// A relay process SIGKILLed mid-batch, several times over (its batches
// acked by Kafka, their deletion not committed): the next relay publishes
// those batches again, and they are the only duplicates; a kafkainbox
// consumer downstream runs every message's effect once. 0 lost, and each
// key's first deliveries stay in order.
func TestKilledRelay(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 8)
	topic := newTopic(t, fx.brokers, 4)
	fx.pg.Exec(t, `CREATE TABLE effects (event_id text NOT NULL, value bytea)`)
	const keys, perKey = 20, 200
	const total = keys * perKey
	for i := range perKey {
		var msgs []outbox.Message
		for k := range keys {
			msgs = append(msgs, outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("key-" + strconv.Itoa(k)), Value: []byte(strconv.Itoa(i))})
		}
		fx.add(t, msgs...)
	}
	pending := func() int { return fx.pg.Count(t, `SELECT count(*) FROM outbox WHERE status = 'pending'`) }
	app := "relay-" + fx.pg.Schema
	start := func() (*exec.Cmd, *bytes.Buffer) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), relayEnv+"=1", relayPG+"="+fx.pg.URL, relaySchema+"="+fx.pg.Schema,
			relayBrokers+"="+strings.Join(fx.brokers, ","), relayApp+"="+app)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		require.NoError(t, cmd.Start())
		return cmd, &out
	}
	var logs []string
	t.Cleanup(func() {
		if t.Failed() {
			for i, l := range logs {
				t.Logf("relay process %d output:\n%s", i, l)
			}
		}
	})

	inFlight := map[string]bool{} // published and not deleted when a relay died
	const kills = 3
	for round := range kills {
		before := pending()
		cmd, out := start()
		target := before - 300
		testsvc.Eventually(t, 90*time.Second, func() bool { return pending() <= target }, "round %d: progress", round)
		// Hold the relay's next deletions: lock every pending row. Its
		// batches are read and published, their DELETE waits.
		lockTx, err := fx.pg.Pool.Begin(context.Background())
		require.NoError(t, err)
		_, err = lockTx.Exec(context.Background(), `SELECT 1 FROM outbox WHERE status = 'pending' FOR UPDATE`)
		require.NoError(t, err)
		testsvc.Eventually(t, 60*time.Second, func() bool {
			return fx.pg.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'`, app) >= 1
		}, "round %d: a batch published and waiting to be deleted", round)
		require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
		_ = cmd.Wait()
		require.NoError(t, lockTx.Rollback(context.Background()))
		logs = append(logs, out.String())

		// What Kafka has that the outbox still holds: the killed batches.
		published := map[string]bool{}
		for _, m := range allMessages(readTopic(t, fx.brokers, topic)) {
			published[header(m, "ce_id")] = true
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
		t.Logf("round %d: killed with %d messages published and not deleted, %d pending", round, n, pending())
	}
	cmd, out := start()
	fx.waitDrained(t, 120*time.Second)
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait(), "graceful stop: %s", out)

	// Kafka: every message at least once; the repeats are the killed
	// batches'; per key, first deliveries in order.
	seen := map[string]int{}
	next := map[string]int{}
	for _, m := range allMessages(readTopic(t, fx.brokers, topic)) {
		id := header(m, "ce_id")
		seen[id]++
		if seen[id] > 1 {
			require.True(t, inFlight[id], "%s published twice but was not in a killed batch", id)
			continue
		}
		v, _ := strconv.Atoi(string(m.Value))
		require.Equal(t, next[string(m.Key)], v, "key %s out of order", m.Key)
		next[string(m.Key)]++
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
	c, err := kafkainbox.New(kafkainbox.Config{
		Brokers: fx.brokers, Topic: topic, GroupID: "g-" + topic,
		Processor: consumer.Config{Ledger: ledger, Hooks: consumer.Hooks{OnOutcome: func(_ *consumer.Message, o inbox.Outcome, _ time.Duration) {
			mu.Lock()
			outcomes[o.Disposition]++
			mu.Unlock()
		}}},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, m.ID, m.Value)
		return err
	})
	require.NoError(t, err)
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
	t.Logf("%d messages, %d published twice (all from killed batches), 0 lost, 0 effects doubled", total, dups)
}
