//go:build linux

package kafkainbox_test

import (
	"bytes"
	"context"
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
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/testsvc"
	kafkainbox "github.com/justonce/justonce/transports/kafka"
)

const (
	helperEnv     = "JUSTONCE_KAFKA_HELPER"
	helperPG      = "JUSTONCE_KAFKA_HELPER_PG"
	helperBrokers = "JUSTONCE_KAFKA_HELPER_BROKERS"
	helperTopic   = "JUSTONCE_KAFKA_HELPER_TOPIC"
	helperGroup   = "JUSTONCE_KAFKA_HELPER_GROUP"
	helperBatch   = "JUSTONCE_KAFKA_HELPER_BATCH"
)

// TestHelperProcess is not a test: it is the consumer process that
// TestKilledConsumerLosesAndDoublesNothing runs (this test binary, run again)
// and kills. Without the helper environment it returns at once.
func TestHelperProcess(t *testing.T) {
	if os.Getenv(helperEnv) != "1" {
		return
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 3*time.Minute) // never outlive the test
	defer cancelTimeout()

	pool, err := pgxpool.New(ctx, os.Getenv(helperPG))
	require.NoError(t, err)
	defer pool.Close()
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	batch, err := strconv.Atoi(os.Getenv(helperBatch))
	require.NoError(t, err)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	c, err := kafkainbox.New(kafkainbox.Config{
		Brokers:     strings.Split(os.Getenv(helperBrokers), ","),
		Topic:       os.Getenv(helperTopic),
		GroupID:     os.Getenv(helperGroup),
		Processor:   consumer.Config{Ledger: ledger, Logger: log},
		Concurrency: 2,
		BatchSize:   batch,
		Reader:      tuneReader,
	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		time.Sleep(time.Millisecond) // a handler that takes a little while
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value, part, off) VALUES ($1, $2, $3, $4)`, m.ID, m.Value, m.Partition, m.Offset)
		return err
	})
	require.NoError(t, err)
	require.NoError(t, c.Run(ctx))
}

// helperProcess starts the consumer subprocess.
func helperProcess(t *testing.T, fx *fixture, brokers []string, topic, group string, batch int) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(),
		helperEnv+"=1",
		helperPG+"="+fx.pg.URL,
		helperBrokers+"="+strings.Join(brokers, ","),
		helperTopic+"="+topic,
		helperGroup+"="+group,
		helperBatch+"="+strconv.Itoa(batch),
	)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, cmd.Start())
	return cmd, &out
}

// A consumer process killed with SIGKILL at random points mid-stream, and
// restarted, several times over: 0 lost, 0 doubled; per event and in batch
// mode.
func TestKilledConsumerLosesAndDoublesNothing(t *testing.T) {
	t.Parallel()
	t.Run("PerEvent", func(t *testing.T) {
		t.Parallel()
		testKilled(t, 0)
	})
	t.Run("Batch", func(t *testing.T) {
		t.Parallel()
		testKilled(t, 50)
	})
}

func testKilled(t *testing.T, batch int) {
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 4)
	group := "g-" + topic
	const n, more = 4000, 1000
	publish(t, brokers, topic, events("k", 0, n, 40)...)

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
	for round := 0; round < kills; round++ {
		before := fx.effects(t)
		cmd, out := helperProcess(t, fx, brokers, topic, group, batch)
		// Wait for it to join (after the killed member's session expired)
		// and make progress, then kill it at a random point.
		testsvc.Eventually(t, 90*time.Second, func() bool { return fx.effects(t) >= before+150 }, "round %d: progress", round)
		time.Sleep(rand.N(400 * time.Millisecond))
		require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
		_ = cmd.Wait()
		mu.Lock()
		logs = append(logs, out.String())
		mu.Unlock()
		t.Logf("round %d: killed with %d effects", round, fx.effects(t))
		if round == 1 {
			// More events while nobody consumes, with IDs seen before.
			publish(t, brokers, topic, events("k", n, n+more, 40)...)
			publish(t, brokers, topic, events("k", 0, 500, 40)...)
		}
	}
	require.Less(t, fx.effects(t), n+more, "the kills must land mid-stream")

	// The last process runs to the end and stops gracefully.
	cmd, out := helperProcess(t, fx, brokers, topic, group, batch)
	testsvc.Eventually(t, 120*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n+more
	}, "everything processed after the kills")
	waitNoLag(t, brokers, group, topic)
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	err := cmd.Wait()
	mu.Lock()
	logs = append(logs, out.String())
	mu.Unlock()
	require.NoError(t, err, "graceful exit")

	fx.assertExactlyOnce(t, n+more)
}
