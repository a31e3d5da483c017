package natsinbox

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// The NATS server process is SIGKILLed while handlers are in flight and
// restarted on the same file store and port; the consumer reconnects by
// itself. Every published event has its effect exactly once: the stream
// kept every message it had acknowledged to the publisher (each is written
// to the file before the PubAck, with the default sync_interval too), and
// the deliveries whose acks the crash lost are answered from the ledger.
func TestNATSServerKilledFileStore(t *testing.T) {
	t.Parallel()
	srv := testsvc.StartNATSProcess(t)
	nc, err := nats.Connect(srv.URL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	e := &env{url: srv.URL, nc: nc, js: mustJS(t, nc)}
	fx := newFixture(t)
	subject := testsvc.Unique("restart")
	stream := e.stream(t, subject, 0)

	const n = 400
	for i := 0; i < n; i++ {
		e.publish(t, subject, "r-"+strconv.Itoa(i), []byte(strconv.Itoa(i)))
	}

	var (
		armed    atomic.Bool
		inFlight atomic.Int64
	)
	entered := make(chan struct{}, 16)
	release := make(chan struct{})
	c, err := New(Config{Conn: nc, Stream: stream, Durable: "rs", Processor: fx.processor(subject),
		Scheduling: consumer.Scheduling{Concurrency: 4}, AckWait: 2 * time.Second}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := fx.insert(ctx, tx, m); err != nil {
			return err
		}
		if armed.Load() {
			inFlight.Add(1)
			defer inFlight.Add(-1)
			select {
			case entered <- struct{}{}:
			default:
			}
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	})
	require.NoError(t, err)
	run(t, c)

	testsvc.Eventually(t, 30*time.Second, func() bool { return fx.runs.Load() >= n/4 }, "a quarter processed")
	armed.Store(true)
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("no handler reached the barrier")
	}
	srv.Kill(t)
	require.Positive(t, inFlight.Load(), "handlers in flight when the server died")
	done := fx.pg.Count(t, `SELECT count(*) FROM effects`)
	require.Less(t, done, n, "work left when the server died")
	srv.Start(t)
	restarted := time.Now()
	close(release)
	armed.Store(false)

	testsvc.Eventually(t, 60*time.Second, func() bool {
		if !nc.IsConnected() {
			return false
		}
		ci, err := e.js.Consumer(context.Background(), stream, "rs")
		if err != nil {
			return false
		}
		info, err := ci.Info(context.Background())
		return err == nil && info.NumAckPending == 0 && info.NumPending == 0 &&
			fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`) == n
	}, "every event processed and acked after the restart")

	t.Logf("all done %s after the restart", time.Since(restarted).Round(time.Millisecond))
	require.Equal(t, n, fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`), "0 lost")
	require.Equal(t, n, fx.pg.Count(t, `SELECT count(*) FROM effects`), "0 doubled")
	for i := 0; i < n; i++ {
		require.Equal(t, 1, fx.effects(t, "r-"+strconv.Itoa(i)))
	}
	t.Logf("%d effects before the kill; after the restart %d deliveries answered Duplicate, %d handler runs that did not commit",
		done, fx.count(inbox.Duplicate), fx.runs.Load()-n)
}
