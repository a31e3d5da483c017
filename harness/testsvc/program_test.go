package testsvc

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"testing"
)

// A Program's Fatal stops the call Catch runs and comes back as an error;
// its cleanups run at Close, last first, and its temporary folders are
// gone after it.
func TestProgram(t *testing.T) {
	var out bytes.Buffer
	p := NewProgram("prog", &out)
	var order []int
	p.Cleanup(func() { order = append(order, 1) })
	p.Cleanup(func() { order = append(order, 2) })
	dir := p.TempDir()
	if _, err := os.Stat(dir); err != nil {
		t.Fatal(err)
	}
	reached := false
	err := Catch(func() {
		p.Fatalf("broke: %d", 42)
		reached = true
	})
	var fe *FatalError
	if !errors.As(err, &fe) || fe.Msg != "broke: 42" || reached || !p.Failed() {
		t.Fatalf("Catch = %v, reached %v, failed %v", err, reached, p.Failed())
	}
	if err := Catch(func() {}); err != nil {
		t.Fatalf("Catch without Fatal = %v", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "not fatal" {
				t.Fatalf("a panic other than Fatal's was %v, want it to go on", r)
			}
		}()
		_ = Catch(func() { panic("not fatal") })
	}()
	p.Logf("hello %s", "there")
	if !strings.Contains(out.String(), "prog: hello there") {
		t.Fatalf("log: %q", out.String())
	}
	p.Close()
	if len(order) != 2 || order[0] != 2 || order[1] != 1 {
		t.Fatalf("cleanups ran %v, want [2 1]", order)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("TempDir %s left after Close: %v", dir, err)
	}
	if p.Context().Err() == nil {
		t.Fatal("Context not cancelled at Close")
	}
}
