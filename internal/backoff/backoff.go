// Package backoff is what is left of the backoff formula's former private
// home: Delay, for the ledger's lease renewal (inbox/lease.go), which has
// not moved to the public package yet. The formula itself lives in the
// public package backoff; remove this one once inbox imports that.
package backoff

import (
	"time"

	pub "github.com/justonce/justonce/backoff"
)

// Delay is the wait before retry n (from 1): a random time between half
// and all of min(initial·multiplier^(n-1), max), as backoff.Backoff.Delay
// computes it.
func Delay(initial, max time.Duration, multiplier float64, n int) time.Duration {
	return pub.Backoff{Initial: initial, Max: max, Multiplier: multiplier}.Delay(n)
}
