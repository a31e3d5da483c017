//go:build unix

package testproc_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/justonce/justonce/consumer/consumertest/testproc"
)

const envRole = "JUSTONCE_TESTPROC_ROLE"

// TestChild is the child's part when envRole says so; otherwise it does
// nothing. It prints "ready", then waits for its Context: "stopped" and
// status 0 on SIGTERM, status 3 when the limit passes first.
func TestChild(t *testing.T) {
	if os.Getenv(envRole) != "child" {
		return
	}
	ctx, cancel := testproc.Context(time.Minute)
	defer cancel()
	fmt.Println("ready")
	<-ctx.Done()
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		os.Exit(3)
	}
	fmt.Println("stopped")
	os.Exit(0)
}

func TestRunOnly(t *testing.T) {
	for name, want := range map[string]string{
		"TestConformance":          "-test.run=^TestConformance$",
		"TestX/kafka.go(v2)/Crash": `-test.run=^TestX$/^kafka\.go\(v2\)$/^Crash$`,
	} {
		if got := testproc.RunOnly(name); got != want {
			t.Errorf("RunOnly(%q) = %q, want %q", name, got, want)
		}
	}
}

func start(t *testing.T) *testproc.Proc {
	p := testproc.Start(t, "child", []string{envRole + "=child"}, testproc.RunOnly("TestChild"))
	deadline := time.Now().Add(30 * time.Second)
	for p.Output() != "ready\n" {
		if time.Now().After(deadline) {
			t.Fatalf("the child did not start: %q", p.Output())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return p
}

// Stop ends the child through its Context: a graceful exit, status 0.
func TestStopEndsTheChildsContext(t *testing.T) {
	t.Parallel()
	p := start(t)
	if err := p.Stop(30 * time.Second); err != nil {
		t.Fatalf("Stop: %v\n%s", err, p.Output())
	}
	if p.Output() != "ready\nstopped\n" {
		t.Fatalf("output %q, want the child's graceful end", p.Output())
	}
}

// Kill ends the child by SIGKILL, and a Stop after it reports that exit.
func TestKill(t *testing.T) {
	t.Parallel()
	p := start(t)
	p.Kill(t)
	err := p.Stop(time.Second)
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("Stop after Kill: %v, want the killed child's exit", err)
	}
	ws, ok := exit.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("child ended with %v, want SIGKILL", err)
	}
	if p.Output() != "ready\n" {
		t.Fatalf("output %q: a killed child runs none of its shutdown", p.Output())
	}
}
