package main

import (
	"os"
	"testing"
)

// child, when set (steps_linux_test.go), runs this test binary as the
// payment service a test started, and reports whether it did.
var child func() (code int, ran bool)

// TestMain runs the tests, or the child process's part.
func TestMain(m *testing.M) {
	if child != nil {
		if code, ran := child(); ran {
			os.Exit(code)
		}
	}
	os.Exit(m.Run())
}
