package testsvc

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/justonce/justonce/consumer/consumertest/testproc"
)

// envNATSChild tells the test binary, run again by StartNATSProcess, to be
// the NATS server: "<store dir>:<port>".
const envNATSChild = "JUSTONCE_TESTSVC_NATS_CHILD"

// natsChildLimit is how long a NATS server process runs at most, so that
// it never outlives its test.
const natsChildLimit = 30 * time.Minute

// NATSProcess is a nats-server with JetStream on a file store in a child
// process: the test binary run again (see NATSProcessChild). Its memory is
// not the test's (a test that measures its own heap sees none of the
// server's), and a test may SIGKILL it (Kill) and start it again on the
// same store and port (Start).
type NATSProcess struct {
	// URL is the server's client URL.
	URL string

	dir  string
	port int
	cmd  *exec.Cmd
	out  *LogBuffer
}

// StartNATSProcess starts a NATS server process with JetStream storing in
// a new temporary directory, on a free loopback port, with the server's
// default sync setting, and waits until it accepts connections. It is
// killed when the test ends (and, on Linux, when the test process dies).
// The test binary must call NATSProcessChild first thing (from TestMain or
// an init function).
func StartNATSProcess(t testing.TB) *NATSProcess {
	t.Helper()
	port, err := freePort()
	if err != nil {
		t.Fatalf("testsvc: free port: %v", err)
	}
	p := &NATSProcess{URL: fmt.Sprintf("nats://127.0.0.1:%d", port), dir: filepath.Join(t.TempDir(), "js"), port: port}
	// One cleanup for every server Start starts: the last one is killed
	// after the test's other cleanups (its consumers shut down first).
	t.Cleanup(p.kill)
	p.Start(t)
	return p
}

// Start starts the server (again, after Kill) on its store and port and
// waits up to 20 s until it accepts connections.
func (p *NATSProcess) Start(t testing.TB) {
	t.Helper()
	p.cmd = exec.Command(os.Args[0], testproc.RunNone)
	p.cmd.Env = append(os.Environ(), envNATSChild+"="+p.dir+":"+strconv.Itoa(p.port))
	p.out = &LogBuffer{}
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	testproc.DieWithParent(p.cmd)
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("testsvc: start the NATS server process: %v", err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		nc, err := nats.Connect(p.URL)
		if err == nil {
			nc.Close()
			return
		}
		if time.Now().After(deadline) {
			p.kill()
			t.Fatalf("testsvc: NATS server process not ready in 20s: %v\n%s", err, p.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Kill SIGKILLs the server, as a crash does, and waits until it has ended.
func (p *NATSProcess) Kill(t testing.TB) {
	t.Helper()
	p.kill()
}

func (p *NATSProcess) kill() {
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	_ = p.cmd.Wait()
	p.cmd = nil
}

// NATSProcessChild makes this process the NATS server StartNATSProcess
// starts, when it is that child: it serves until SIGTERM, SIGKILL or 30
// minutes, then exits. Otherwise it returns at once. Call it first thing
// in TestMain, or from an init function, of a test binary that calls
// StartNATSProcess.
func NATSProcessChild() {
	v := os.Getenv(envNATSChild)
	if v == "" {
		return
	}
	if err := natsChild(v); err != nil {
		fmt.Fprintf(os.Stderr, "nats-server process: %v\n", err)
		os.Exit(2)
	}
	os.Exit(0)
}

func natsChild(v string) error {
	i := strings.LastIndex(v, ":")
	if i < 0 {
		return fmt.Errorf("%s=%q: want <dir>:<port>", envNATSChild, v)
	}
	port, err := strconv.Atoi(v[i+1:])
	if err != nil {
		return err
	}
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: v[:i], NoLog: true, NoSigs: true})
	if err != nil {
		return err
	}
	ns.Start()
	if !ns.ReadyForConnections(20 * time.Second) {
		return fmt.Errorf("not ready in 20s")
	}
	ctx, cancel := testproc.Context(natsChildLimit)
	defer cancel()
	<-ctx.Done()
	ns.Shutdown()
	ns.WaitForShutdown()
	return nil
}
