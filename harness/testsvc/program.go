package testsvc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"testing"
)

// Program is a testing.TB for a program that starts this package's
// services outside a test (the chaos and soak runs of harness/chaos): a
// replica set, Sentinel, a NATS cluster. Fatal, Fatalf, FailNow and the
// Skip methods panic with a *FatalError, which Catch turns back into an
// error; Cleanup functions run, last registered first, at Close; TempDir
// makes a folder removed at Close; Log goes to Output (stderr by default).
//
// A service's methods call Fatal from the caller's goroutine, so a program
// wraps each call that may fail in Catch.
type Program struct {
	// testing.TB is nil: it only gives Program the interface's unexported
	// method. Every other method is Program's own.
	testing.TB

	name string
	out  io.Writer
	ctx  context.Context

	mu       sync.Mutex
	cancel   context.CancelFunc
	cleanups []func()
	failed   bool
}

// FatalError is what a Program's Fatal (or FailNow, or Skip) panics with,
// and what Catch returns.
type FatalError struct {
	Msg string
}

func (e *FatalError) Error() string { return e.Msg }

// NewProgram returns a Program named name whose log lines go to out (nil:
// stderr).
func NewProgram(name string, out io.Writer) *Program {
	if out == nil {
		out = os.Stderr
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Program{name: name, out: out, ctx: ctx, cancel: cancel}
}

// Catch runs f and returns the *FatalError a Program's Fatal panicked with
// in it, or nil. Other panics go on.
func Catch(f func()) (err error) {
	defer func() {
		if r := recover(); r != nil {
			var fe *FatalError
			if e, ok := r.(error); ok && errors.As(e, &fe) {
				err = fe
				return
			}
			panic(r)
		}
	}()
	f()
	return nil
}

// Close runs the Cleanup functions, last registered first, and cancels
// Context. A cleanup that calls Fatal stops only itself.
func (p *Program) Close() {
	p.mu.Lock()
	cs := p.cleanups
	p.cleanups = nil
	p.mu.Unlock()
	for i := len(cs) - 1; i >= 0; i-- {
		if err := Catch(cs[i]); err != nil {
			p.Logf("cleanup: %v", err)
		}
	}
	p.cancel()
}

// Cleanup registers f to run at Close.
func (p *Program) Cleanup(f func()) {
	p.mu.Lock()
	p.cleanups = append(p.cleanups, f)
	p.mu.Unlock()
}

// Name is the name given to NewProgram.
func (p *Program) Name() string { return p.name }

// Helper does nothing.
func (p *Program) Helper() {}

// Log writes a line to Output.
func (p *Program) Log(args ...any) { fmt.Fprintln(p.out, append([]any{p.name + ":"}, args...)...) }

// Logf writes a line to Output.
func (p *Program) Logf(format string, args ...any) {
	fmt.Fprintf(p.out, "%s: %s\n", p.name, fmt.Sprintf(format, args...))
}

// Error logs and marks the program failed.
func (p *Program) Error(args ...any) {
	p.Log(args...)
	p.Fail()
}

// Errorf logs and marks the program failed.
func (p *Program) Errorf(format string, args ...any) {
	p.Logf(format, args...)
	p.Fail()
}

// Fail marks the program failed.
func (p *Program) Fail() {
	p.mu.Lock()
	p.failed = true
	p.mu.Unlock()
}

// Failed reports whether Fail (or Error, or Fatal) was called.
func (p *Program) Failed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failed
}

// FailNow marks the program failed and panics with a *FatalError.
func (p *Program) FailNow() { p.fatal("FailNow") }

// Fatal marks the program failed and panics with a *FatalError.
func (p *Program) Fatal(args ...any) { p.fatal(fmt.Sprint(args...)) }

// Fatalf marks the program failed and panics with a *FatalError.
func (p *Program) Fatalf(format string, args ...any) { p.fatal(fmt.Sprintf(format, args...)) }

func (p *Program) fatal(msg string) {
	p.Fail()
	panic(&FatalError{Msg: msg})
}

// Skip panics with a *FatalError: a program cannot skip.
func (p *Program) Skip(args ...any) { p.fatal("skip: " + fmt.Sprint(args...)) }

// SkipNow panics with a *FatalError.
func (p *Program) SkipNow() { p.fatal("skip") }

// Skipf panics with a *FatalError.
func (p *Program) Skipf(format string, args ...any) { p.fatal("skip: " + fmt.Sprintf(format, args...)) }

// Skipped is false.
func (p *Program) Skipped() bool { return false }

// TempDir makes a new folder, removed at Close.
func (p *Program) TempDir() string {
	dir, err := os.MkdirTemp("", "justonce-program-")
	if err != nil {
		p.Fatalf("testsvc: TempDir: %v", err)
	}
	p.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// ArtifactDir is TempDir.
func (p *Program) ArtifactDir() string { return p.TempDir() }

// Setenv sets an environment variable until Close.
func (p *Program) Setenv(key, value string) {
	old, had := os.LookupEnv(key)
	if err := os.Setenv(key, value); err != nil {
		p.Fatalf("testsvc: Setenv: %v", err)
	}
	p.Cleanup(func() {
		if had {
			_ = os.Setenv(key, old)
		} else {
			_ = os.Unsetenv(key)
		}
	})
}

// Chdir changes the working directory until Close.
func (p *Program) Chdir(dir string) {
	old, err := os.Getwd()
	if err != nil {
		p.Fatalf("testsvc: Chdir: %v", err)
	}
	if err := os.Chdir(dir); err != nil {
		p.Fatalf("testsvc: Chdir: %v", err)
	}
	p.Cleanup(func() { _ = os.Chdir(old) })
}

// Attr logs the attribute.
func (p *Program) Attr(key, value string) { p.Logf("%s=%s", key, value) }

// Context is cancelled at Close.
func (p *Program) Context() context.Context { return p.ctx }

// Output is where the log lines go.
func (p *Program) Output() io.Writer { return p.out }
