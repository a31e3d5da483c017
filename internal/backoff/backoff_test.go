package backoff

import (
	"testing"
	"time"
)

func TestDelay(t *testing.T) {
	for n, hi := range map[int]time.Duration{1: 100, 2: 200, 3: 400, 4: 500, 40: 500} {
		hi *= time.Millisecond
		for i := 0; i < 200; i++ {
			if d := Delay(100*time.Millisecond, 500*time.Millisecond, 2, n); d < hi/2 || d > hi {
				t.Fatalf("retry %d: %v outside [%v, %v]", n, d, hi/2, hi)
			}
		}
	}
}
