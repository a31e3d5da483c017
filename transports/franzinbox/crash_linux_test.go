//go:build linux

package franzinbox_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
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
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

const (
	helperEnv     = "JUSTONCE_FRANZ_HELPER"
	helperPG      = "JUSTONCE_FRANZ_HELPER_PG"
	helperBrokers = "JUSTONCE_FRANZ_HELPER_BROKERS"
	helperTopic   = "JUSTONCE_FRANZ_HELPER_TOPIC"
	helperGroup   = "JUSTONCE_FRANZ_HELPER_GROUP"
	helperBatch   = "JUSTONCE_FRANZ_HELPER_BATCH"
	helperGate    = "JUSTONCE_FRANZ_HELPER_GATE"
)

// The test binary is the consumer process that
// TestKilledConsumerLosesAndDoublesNothing starts and kills, when the
// helper environment is set (see TestMain).
func init() {
	child = func() (int, bool) {
		if os.Getenv(helperEnv) != "1" {
			return 0, false
		}
		return consumerProcess(), true
	}
}

// consumerProcess is a consumer with the package's default group timings.
// Its handler inserts the effect, then takes the shared advisory lock
// helperGate inside the transaction: while the test holds that lock
// exclusively, handlers wait in flight, their effects written and not
// committed.
func consumerProcess() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "consumer process:", err)
		return 1
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 3*time.Minute) // never outlive the test
	defer cancelTimeout()

	pool, err := pgxpool.New(ctx, os.Getenv(helperPG))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ledger, err := inbox.New(pool, inbox.Config{Logger: log})
	if err != nil {
		return fail(err)
	}
	batch, err := strconv.Atoi(os.Getenv(helperBatch))
	if err != nil {
		return fail(err)
	}
	gate, err := strconv.ParseInt(os.Getenv(helperGate), 10, 64)
	if err != nil {
		return fail(err)
	}
	c, err := franzinbox.New(franzinbox.Config{
		Brokers:    strings.Split(os.Getenv(helperBrokers), ","),
		Topics:     []string{os.Getenv(helperTopic)},
		GroupID:    os.Getenv(helperGroup),
		Processor:  consumer.Config{Ledger: ledger},
		Scheduling: consumer.Scheduling{Concurrency: 2, BatchSize: batch},
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		time.Sleep(time.Millisecond) // a handler that takes a little while
		if _, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value, part, off) VALUES ($1, $2, $3, $4)`, m.ID, m.Value, m.Partition, m.Offset); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock_shared($1)`, gate)
		return err
	})
	if err != nil {
		return fail(err)
	}
	if err := c.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// helperProcess starts the consumer subprocess.
func helperProcess(t *testing.T, fx *fixture, brokers []string, topic, group string, batch int, gate int64) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(),
		helperEnv+"=1",
		helperPG+"="+fx.pg.URL,
		helperBrokers+"="+strings.Join(brokers, ","),
		helperTopic+"="+topic,
		helperGroup+"="+group,
		helperBatch+"="+strconv.Itoa(batch),
		helperGate+"="+strconv.FormatInt(gate, 10),
	)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, cmd.Start())
	return cmd, &out
}

// gateWaiters counts the transactions waiting for the advisory lock gate.
func gateWaiters(t *testing.T, fx *fixture, gate int64) int {
	return fx.pg.Count(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid = 0 AND objid = $1 AND objsubid = 1`, gate)
}

// A consumer process killed with SIGKILL mid-stream, with handlers in
// flight (their effects written, their transactions not committed), and
// restarted, several times over: 0 lost, 0 doubled; per event (BatchSize
// 1) and with the default batches. The process uses the package's default group timings: each restart
// consumes again within seconds of the kill, not after kafka-go's 30 s
// session timeout.
func TestKilledConsumerLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	t.Run("PerEvent", func(t *testing.T) {
		t.Parallel()
		testKilled(t, 1)
	})
	t.Run("Batch", func(t *testing.T) {
		t.Parallel()
		testKilled(t, 0)
	})
}

// restartBound is how soon a consumer restarted after SIGKILL must have its
// first effect: the default session timeout (10 s) plus a rebalance; with
// franz-go's own default it would be over 45 s.
const restartBound = 15 * time.Second

func testKilled(t *testing.T, batch int) {
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 4)
	group := "g-" + topic
	const n, more = 4000, 1000
	publish(t, brokers, topic, events("k", 0, n, 40)...)
	gate := 1 + rand.Int64N(1<<31-1) // one advisory lock key per test

	// The test's hold on the gate: a connection of its own.
	lockConn, err := pgx.Connect(context.Background(), fx.pg.URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lockConn.Close(context.Background()) })
	closeGate := func() {
		_, err := lockConn.Exec(context.Background(), `SELECT pg_advisory_lock($1)`, gate)
		require.NoError(t, err)
	}
	openGate := func() {
		_, err := lockConn.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, gate)
		require.NoError(t, err)
	}

	var logs []string
	var mu sync.Mutex
	t.Cleanup(func() {
		if t.Failed() {
			mu.Lock()
			defer mu.Unlock()
			for i, l := range logs {
				t.Logf("consumer process %d output:\n%s", i, l)
			}
		}
	})
	const kills = 4
	var restarts []time.Duration
	for round := 0; round < kills; round++ {
		before := fx.effects(t)
		started := time.Now()
		cmd, out := helperProcess(t, fx, brokers, topic, group, batch, gate)
		testsvc.Eventually(t, 90*time.Second, func() bool { return fx.effects(t) > before }, "round %d: first effect", round)
		if round > 0 {
			// Started right after the previous process was killed.
			took := time.Since(started)
			restarts = append(restarts, took)
			require.Less(t, took, restartBound, "round %d: consuming again after a SIGKILL took %s", round, took)
		}
		// A random point in the stream, early enough that work remains.
		target := before + 150 + rand.IntN(300)
		testsvc.Eventually(t, 90*time.Second, func() bool { return fx.effects(t) >= target }, "round %d: progress", round)
		// Hold the handlers in flight, then kill.
		closeGate()
		testsvc.Eventually(t, 30*time.Second, func() bool { return gateWaiters(t, fx, gate) >= 1 }, "round %d: a handler in flight", round)
		inFlight := gateWaiters(t, fx, gate)
		require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
		_ = cmd.Wait()
		openGate()
		mu.Lock()
		logs = append(logs, out.String())
		mu.Unlock()
		t.Logf("round %d: killed with %d handlers in flight and %d effects committed", round, inFlight, fx.effects(t))
		if round == 1 {
			// More events while nobody consumes, with IDs seen before.
			publish(t, brokers, topic, events("k", n, n+more, 40)...)
			publish(t, brokers, topic, events("k", 0, 500, 40)...)
		}
	}
	require.Less(t, fx.effects(t), n+more, "the kills must land mid-stream")

	// The last process runs to the end and stops gracefully.
	started := time.Now()
	before := fx.effects(t)
	cmd, out := helperProcess(t, fx, brokers, topic, group, batch, gate)
	testsvc.Eventually(t, 90*time.Second, func() bool { return fx.effects(t) > before }, "last round: first effect")
	restarts = append(restarts, time.Since(started))
	require.Less(t, restarts[len(restarts)-1], restartBound, "last round: consuming again after a SIGKILL")
	testsvc.Eventually(t, 120*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n+more
	}, "everything processed after the kills")
	waitNoLag(t, brokers, group, topic)
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	err = cmd.Wait()
	mu.Lock()
	logs = append(logs, out.String())
	mu.Unlock()
	require.NoError(t, err, "graceful exit")

	fx.assertExactlyOnce(t, n+more)
	t.Logf("restart after SIGKILL to first effect: %v", restarts)
}
