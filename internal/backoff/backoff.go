// Package backoff computes exponential backoff with jitter, the one
// formula the runtime and the HTTP client retry with.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Sleep waits d, or until ctx ends: then it returns ctx's error.
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

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
