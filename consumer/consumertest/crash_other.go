//go:build !linux

package consumertest

import "testing"

// runAsChild does nothing: the Crash cases, and their child processes, run
// on Linux only.
func runAsChild(*testing.T, Harness) {}

func testCrash(t *testing.T, _ *suite, _ int) {
	t.Skip("consumertest: the Crash cases run on Linux only")
}
