package natsinbox

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// Environment of the NATS server child process: "<store dir>:<port>".
const envServerChild = "JUSTONCE_NATS_SERVER_CHILD"

// serverChild runs a NATS server with JetStream on a file store, with the
// server's default sync setting (fsync every 2 minutes), until it is
// killed.
func serverChild() {
	v := os.Getenv(envServerChild)
	i := strings.LastIndex(v, ":")
	dir := v[:max(i, 0)]
	p, err := strconv.Atoi(v[i+1:])
	if err == nil {
		var ns *server.Server
		ns, err = server.NewServer(&server.Options{Host: "127.0.0.1", Port: p, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
		if err == nil {
			ns.Start()
			if ns.ReadyForConnections(20 * time.Second) {
				select {}
			}
			err = fmt.Errorf("not ready")
		}
	}
	fmt.Fprintf(os.Stderr, "server child: %v\n", err)
	os.Exit(2)
}

// natsProcess is a NATS server in a child process.
type natsProcess struct {
	cmd *exec.Cmd
	url string
}

// startNATSProcess starts a server storing under dir on port and waits
// until it accepts connections. The caller kills it.
func startNATSProcess(t *testing.T, dir string, port int) *natsProcess {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envServerChild+"="+dir+":"+strconv.Itoa(port))
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	p := &natsProcess{cmd: cmd, url: fmt.Sprintf("nats://127.0.0.1:%d", port)}
	deadline := time.Now().Add(20 * time.Second)
	for {
		nc, err := nats.Connect(p.url)
		if err == nil {
			nc.Close()
			return p
		}
		if time.Now().After(deadline) {
			p.kill()
			t.Fatalf("NATS server process not ready: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// kill SIGKILLs the server (once) and waits for it to exit.
func (p *natsProcess) kill() {
	if p.cmd.ProcessState != nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Wait()
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// The NATS server process is SIGKILLed while handlers are in flight and
// restarted on the same file store and port; the consumer reconnects by
// itself. Every published event has its effect exactly once: the stream
// kept every message it had acknowledged to the publisher (each is written
// to the file before the PubAck, with the default sync_interval too), and
// the deliveries whose acks the crash lost are answered from the ledger.
func TestNATSServerKilledFileStore(t *testing.T) {
	t.Parallel()
	dir, port := filepath.Join(t.TempDir(), "js"), freePort(t)
	srv := startNATSProcess(t, dir, port)
	t.Cleanup(func() { srv.kill() }) // the last server, after the test's other cleanups
	nc, err := nats.Connect(srv.url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	e := &env{url: srv.url, nc: nc, js: mustJS(t, nc)}
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
	srv.kill()
	require.Positive(t, inFlight.Load(), "handlers in flight when the server died")
	done := fx.pg.Count(t, `SELECT count(*) FROM effects`)
	require.Less(t, done, n, "work left when the server died")
	srv = startNATSProcess(t, dir, port)
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
