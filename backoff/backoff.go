// Package backoff is the exponential backoff with jitter that justonce
// retries with: the runtime between a message's attempts
// (consumer.Config.Backoff and StoreBackoff), the HTTP client
// (httpretry.Transport.Backoff) and the gRPC client
// (grpcretry.Config.Backoff). It depends only on the standard library, so
// a client program that uses it links no database driver.
//
// Each user documents the defaults of the fields a Backoff leaves unset.
// They share Initial (DefaultInitial, 100 ms) and Multiplier
// (DefaultMultiplier, 2) and differ in Max: the runtime waits up to
// DefaultMax (30 s) between attempts, the HTTP and gRPC clients up to
// 5 s (httpretry.DefaultBackoffMax, grpcretry.DefaultBackoffMax), as a
// caller is waiting for their answer.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Defaults Delay gives the fields of a Backoff left unset.
const (
	DefaultInitial    = 100 * time.Millisecond
	DefaultMax        = 30 * time.Second
	DefaultMultiplier = 2.0
)

// Backoff is exponential backoff with jitter: the wait after failed attempt
// n (from 1) is a random time between half and all of
// min(Initial·Multiplier^(n-1), Max). A field is unset when Initial or Max
// is 0 or less, or Multiplier is less than 1; Delay gives it its default
// (DefaultInitial, DefaultMax, DefaultMultiplier), and Or gives it a user's
// own. The zero value is ready to use.
type Backoff struct {
	Initial    time.Duration // the first wait's ceiling; default 100 ms
	Max        time.Duration // no wait is longer; default 30 s (5 s in the clients)
	Multiplier float64       // the ceiling's growth per attempt; default 2
}

// Or returns b with each field b leaves unset taken from def. The HTTP and
// gRPC clients fill their 5-second Max this way.
func (b Backoff) Or(def Backoff) Backoff {
	if b.Initial <= 0 {
		b.Initial = def.Initial
	}
	if b.Max <= 0 {
		b.Max = def.Max
	}
	if b.Multiplier < 1 {
		b.Multiplier = def.Multiplier
	}
	return b
}

// Delay returns the wait after failed attempt n (from 1): a random time
// between half and all of min(Initial·Multiplier^(n-1), Max), with unset
// fields at their defaults.
func (b Backoff) Delay(n int) time.Duration {
	b = b.Or(Backoff{Initial: DefaultInitial, Max: DefaultMax, Multiplier: DefaultMultiplier})
	d := float64(b.Initial)
	for i := 1; i < n && d < float64(b.Max); i++ {
		d *= b.Multiplier
	}
	d = min(d, float64(b.Max))
	half := time.Duration(d / 2)
	return half + rand.N(time.Duration(d)-half+1)
}

// Sleep waits d, or until ctx ends: then it returns ctx's error. A d of 0
// or less returns at once, with ctx's error if it has ended.
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
