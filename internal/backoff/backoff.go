// Package backoff computes exponential backoff with jitter, the one
// formula the runtime and the HTTP client retry with.
package backoff

import (
	"math/rand/v2"
	"time"
)

// Delay is the wait before retry n (from 1): a random time between half
// and all of min(initial·multiplier^(n-1), max).
func Delay(initial, max time.Duration, multiplier float64, n int) time.Duration {
	d := float64(initial)
	for i := 1; i < n && d < float64(max); i++ {
		d *= multiplier
	}
	d = min(d, float64(max))
	half := time.Duration(d / 2)
	return half + rand.N(time.Duration(d)-half+1)
}
