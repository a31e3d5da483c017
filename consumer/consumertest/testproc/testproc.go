// Package testproc runs the test binary again as a child process that a
// test can SIGKILL: the way to prove what survives a crash of the process
// that runs a consumer or a relay. The conformance suite's crash case
// (package consumertest) runs a consumer in one, and the project's outbox
// tests a relay.
//
// The parent starts the child with Start, giving it flags (RunOnly, to run
// one test again, whose code sees the environment and plays the child's
// part; or RunNone, for a child whose part starts in an init function or
// TestMain) and an environment that says what to do. The child runs until
// its Context ends (SIGTERM, or a time limit so that it never outlives the
// test). The parent ends it with Kill (a crash) or Stop (a graceful
// shutdown, whose exit status it checks).
//
// On Linux the child is SIGKILLed when the parent dies (a parent killed by
// a test timeout leaves no consumer behind). Kill and Stop need a Unix
// system.
package testproc

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// RunNone is the flag that makes the child run no test: for a child whose
// part starts in an init function or in TestMain.
const RunNone = "-test.run=^$"

// RunOnly returns the flag that makes the child run only the test (or
// subtest) named name, as testing.T.Name gives it, and the subtests it
// starts.
func RunOnly(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return "-test.run=" + strings.Join(parts, "/")
}

// Proc is a child process Start started.
type Proc struct {
	name string
	cmd  *exec.Cmd
	out  buffer
	done chan struct{} // closed when the process has ended
	err  error         // Wait's, once done is closed
}

// Start runs the test binary again with args as its flags and env added to
// this process's environment. name names the child in the test's log: its
// output (Output) is logged when the test fails. The child is killed when
// the test ends if it still runs.
func Start(t testing.TB, name string, env []string, args ...string) *Proc {
	t.Helper()
	p := &Proc{name: name, done: make(chan struct{})}
	p.cmd = exec.Command(os.Args[0], args...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	DieWithParent(p.cmd)
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("testproc: start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("%s (pid %d) output:\n%s", p.name, p.cmd.Process.Pid, p.Output())
		}
	})
	return p
}

// Kill SIGKILLs the child, as a crash does, and waits until it has ended.
func (p *Proc) Kill(t testing.TB) {
	t.Helper()
	if err := p.kill(); err != nil {
		t.Fatalf("testproc: kill %s: %v", p.name, err)
	}
}

func (p *Proc) kill() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	err := p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
	return err
}

// Stop sends SIGTERM and waits up to timeout for the child to end. It
// returns the child's exit error: nil when it exited with status 0, an
// *exec.ExitError otherwise; a child still running after timeout is killed
// and Stop returns an error that says so.
func (p *Proc) Stop(timeout time.Duration) error {
	// An error means the child has ended already (or is ending): its
	// exit error follows.
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.err
	case <-time.After(timeout):
		_ = p.kill()
		return fmt.Errorf("testproc: %s did not end within %s of SIGTERM: killed", p.name, timeout)
	}
}

// Output returns what the child wrote to its stdout and stderr so far.
func (p *Proc) Output() string { return p.out.String() }

// Context is the child's: it ends on SIGTERM (Stop), or after limit, so
// that a child never outlives its test.
func Context(limit time.Duration) (context.Context, context.CancelFunc) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	ctx, cancel := context.WithTimeout(ctx, limit)
	return ctx, func() {
		cancel()
		stop()
	}
}

// buffer is a bytes.Buffer safe for the child's two writers and a reader.
type buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
