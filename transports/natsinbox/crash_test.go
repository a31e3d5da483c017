package natsinbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// Environment of the crashing child process.
const (
	envCrashChild   = "JUSTONCE_NATS_CRASH_CHILD"
	envCrashNATS    = "JUSTONCE_NATS_CRASH_URL"
	envCrashPG      = "JUSTONCE_NATS_CRASH_PG"
	envCrashStream  = "JUSTONCE_NATS_CRASH_STREAM"
	crashID         = "crash-me"
	crashDurable    = "crashy"
	crashAckWait    = 2 * time.Second
	crashLedgerTTL  = time.Hour
	crashScopeLabel = "crash"
)

// crashConfig is the consumer both processes run.
func crashConfig(nc *nats.Conn, stream string, p consumer.Config) Config {
	p.Scope = crashScopeLabel
	p.TTL = crashLedgerTTL
	return Config{Conn: nc, Stream: stream, Durable: crashDurable, AckWait: crashAckWait, Processor: p}
}

// A consumer killed (SIGKILL) after the ledger's transaction committed and
// before the ack: JetStream redelivers the message after AckWait, the next
// consumer finds it in the ledger, skips the handler and acks it.
func TestCrashAfterCommitBeforeAck(t *testing.T) {
	t.Parallel()
	e, fx := newEnv(t), newFixture(t)
	subject := testsvc.Unique("crash")
	stream := e.stream(t, subject, 0)
	e.publish(t, subject, "before", []byte("1"))
	e.publish(t, subject, crashID, []byte("2"))
	e.publish(t, subject, "after", []byte("3"))

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envCrashChild+"=1", envCrashNATS+"="+e.url, envCrashPG+"="+fx.pg.URL, envCrashStream+"="+stream)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "child output:\n%s", out)
	ws, ok := exit.Sys().(syscall.WaitStatus)
	require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "child must die by SIGKILL, got %v\n%s", err, out)

	// The child committed the event and never acked it.
	require.Equal(t, 1, fx.effects(t, crashID), "committed before the crash")
	rec, err := fx.ledger.Lookup(context.Background(), inbox.Key{Scope: crashScopeLabel, ID: crashID})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusDone, rec.Status)
	ci := e.consumerInfo(t, stream, crashDurable)
	// At most the first was acked: in one batch with the crashed message,
	// its fire-and-forget ack may not have left the process before the
	// kill.
	require.LessOrEqual(t, ci.AckFloor.Stream, uint64(1), "the crashed message was not acked")

	c, err := New(crashConfig(e.nc, stream, fx.processor("")), fx.insert)
	require.NoError(t, err)
	run(t, c)
	testsvc.Eventually(t, 20*time.Second, func() bool {
		ci := e.consumerInfo(t, stream, crashDurable)
		return ci.NumAckPending == 0 && ci.NumPending == 0 && fx.effects(t, "after") == 1
	}, "redelivered and acked")
	require.Equal(t, []inbox.Disposition{inbox.Duplicate}, fx.outcomesOf(crashID), "redelivery skipped as a duplicate")
	require.Equal(t, 1, fx.effects(t, crashID), "ran once")
	require.Equal(t, 3, fx.pg.Count(t, `SELECT count(*) FROM effects`))
	// The child ran "after" too when the three were pulled together: they
	// committed in one batch before the first ack.
	require.LessOrEqual(t, fx.runs.Load(), int64(1), "the surviving consumer ran at most the message after the crash")
}

// crashChild is the consumer process TestCrashAfterCommitBeforeAck kills
// (TestMain runs it in the child instead of the tests). It exits with
// status 2 if anything goes wrong before the kill.
func crashChild() {
	fail := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "crash child: "+format+"\n", args...)
		os.Exit(2)
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv(envCrashPG))
	if err != nil {
		fail("%v", err)
	}
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		fail("%v", err)
	}
	nc, err := nats.Connect(os.Getenv(envCrashNATS))
	if err != nil {
		fail("%v", err)
	}
	cfg := crashConfig(nc, os.Getenv(envCrashStream), consumer.Config{Ledger: ledger})
	h := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, m.ID, m.Value)
		return err
	}
	cfg.beforeAck = func(m *consumer.Message) {
		if m.ID == crashID {
			// The transaction has committed; die before the ack leaves.
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
	}
	c, err := New(cfg, h)
	if err != nil {
		fail("%v", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = c.Run(ctx)
	fail("should have been killed, Run returned %v", errors.Join(err, ctx.Err()))
}
