package backoff_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/justonce/justonce/backoff"
)

// within fails unless every one of many draws of b.Delay(n) is in [lo, hi].
func within(t *testing.T, b backoff.Backoff, n int, lo, hi time.Duration) {
	t.Helper()
	for i := 0; i < 200; i++ {
		if d := b.Delay(n); d < lo || d > hi {
			t.Fatalf("%+v retry %d: %v outside [%v, %v]", b, n, d, lo, hi)
		}
	}
}

func TestDelay(t *testing.T) {
	b := backoff.Backoff{Initial: 100 * time.Millisecond, Max: 500 * time.Millisecond, Multiplier: 2}
	for n, hi := range map[int]time.Duration{1: 100, 2: 200, 3: 400, 4: 500, 40: 500} {
		hi *= time.Millisecond
		within(t, b, n, hi/2, hi)
	}
	b.Multiplier = 3
	within(t, b, 2, 150*time.Millisecond, 300*time.Millisecond)
}

// The zero value's fields take the defaults: 100 ms, doubling, at most 30 s.
func TestDelayDefaults(t *testing.T) {
	var zero backoff.Backoff
	within(t, zero, 1, 50*time.Millisecond, 100*time.Millisecond)
	within(t, zero, 2, 100*time.Millisecond, 200*time.Millisecond)
	within(t, zero, 40, 15*time.Second, 30*time.Second)
	within(t, zero, 1<<20, 15*time.Second, 30*time.Second)
	// Nonsense values are unset too.
	within(t, backoff.Backoff{Initial: -time.Second, Max: -time.Second, Multiplier: 0.5}, 40, 15*time.Second, 30*time.Second)
	if backoff.DefaultInitial != 100*time.Millisecond || backoff.DefaultMax != 30*time.Second || backoff.DefaultMultiplier != 2 {
		t.Fatal("the documented defaults changed")
	}
}

func TestOr(t *testing.T) {
	def := backoff.Backoff{Initial: time.Second, Max: 5 * time.Second, Multiplier: 3}
	if got := (backoff.Backoff{}).Or(def); got != def {
		t.Fatalf("zero.Or(def) = %+v", got)
	}
	set := backoff.Backoff{Initial: time.Millisecond, Max: time.Minute, Multiplier: 1.5}
	if got := set.Or(def); got != set {
		t.Fatalf("set.Or(def) = %+v", got)
	}
	if got := (backoff.Backoff{Initial: time.Millisecond}).Or(backoff.Backoff{Max: 5 * time.Second}); got != (backoff.Backoff{Initial: time.Millisecond, Max: 5 * time.Second}) {
		t.Fatalf("partial Or = %+v", got)
	}
}

func TestSleep(t *testing.T) {
	if err := backoff.Sleep(context.Background(), time.Millisecond); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := backoff.Sleep(ctx, 0); !errors.Is(err, context.Canceled) {
		t.Fatalf("Sleep(ended, 0) = %v", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := backoff.Sleep(ctx, time.Hour); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Sleep(ctx, 1h) = %v", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("Sleep outlived its context by %v", took)
	}
}

// The third retry waits between half and all of 100 ms·2², a zero Backoff
// at most 30 s; a client fills its own Max with Or.
func ExampleBackoff() {
	b := backoff.Backoff{Initial: 100 * time.Millisecond, Max: 2 * time.Second}
	d := b.Delay(3)
	fmt.Println(d >= 200*time.Millisecond && d <= 400*time.Millisecond)
	fmt.Println((backoff.Backoff{}).Or(backoff.Backoff{Max: 5 * time.Second}).Max)
	// Output:
	// true
	// 5s
}
