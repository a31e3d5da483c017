package main

import (
	"testing"
	"time"
)

// The p99 of a histogram is within a bucket (10 %) of the true one, also
// after a round trip through a worker's "@lat" line.
func TestHistogramQuantile(t *testing.T) {
	h := newHistogram()
	for i := 1; i <= 1000; i++ {
		h.add(time.Duration(i) * time.Millisecond)
	}
	h = decodeHistogram(h.encode())
	if h.count() != 1000 {
		t.Fatalf("count %d", h.count())
	}
	for q, want := range map[float64]time.Duration{0.5: 500 * time.Millisecond, 0.99: 990 * time.Millisecond} {
		got := h.quantile(q)
		if got < want || got > want*11/10+time.Millisecond {
			t.Errorf("q%.2f = %s, want %s to %s", q, got, want, want*11/10)
		}
	}
	if newHistogram().quantile(0.99) != 0 {
		t.Error("empty histogram's quantile is not 0")
	}
}

// series builds a process's samples, one every 10 s, from f(i).
func series(n int, f func(i int) (heap, goroutines int64)) *procStats {
	p := &procStats{name: "w", incarnation: 1}
	for i := 0; i < n; i++ {
		h, g := f(i)
		p.samples = append(p.samples, procSample{at: time.Duration(i) * 10 * time.Second, incarnation: 1, heap: h, goroutines: g, fds: 20, conns: 10})
	}
	return p
}

func leaks(v procVerdict) map[string]bool {
	out := map[string]bool{}
	for _, c := range v.checks {
		if c.leak {
			out[c.measure] = true
		}
	}
	return out
}

// A leak is a steady rise after the warm-up; a step (a pool filled once),
// noise, or a rise within the warm-up is not.
func TestSoakLeakDefinition(t *testing.T) {
	s := &soakStats{so: soakOptions{warmup: 2 * time.Minute, heapGrowth: 30, heapFloor: 4, countMargin: 25}}
	const mib = 1 << 20
	for name, c := range map[string]struct {
		p    *procStats
		want map[string]bool
	}{
		"flat with noise": {series(60, func(i int) (int64, int64) { return int64(20+i%3) * mib, int64(30 + i%4) }), map[string]bool{}},
		"heap grows steadily": {series(60, func(i int) (int64, int64) { return int64(10+i/2) * mib, 30 }),
			map[string]bool{"heap": true}},
		"goroutines grow steadily": {series(60, func(i int) (int64, int64) { return 20 * mib, int64(30 + i) }),
			map[string]bool{"goroutines": true}},
		"a step once after the warm-up": {series(60, func(i int) (int64, int64) {
			if i > 30 {
				return 40 * mib, 80
			}
			return 20 * mib, 30
		}), map[string]bool{}},
		"growth during the warm-up only": {series(60, func(i int) (int64, int64) {
			return int64(min(i, 12)+10) * mib, int64(min(i, 12) + 30)
		}), map[string]bool{}},
		"slow and small heap growth": {series(60, func(i int) (int64, int64) { return 20*mib + int64(i)*mib/60, 30 }), map[string]bool{}},
	} {
		v := s.verdict(c.p)
		if len(v.checks) == 0 {
			t.Fatalf("%s: not judged: %s", name, v.note)
		}
		got := leaks(v)
		if len(got) != len(c.want) {
			t.Errorf("%s: leaks %v, want %v (%+v)", name, got, c.want, v.checks)
			continue
		}
		for m := range c.want {
			if !got[m] {
				t.Errorf("%s: leaks %v, want %v", name, got, c.want)
			}
		}
	}
	short := series(20, func(int) (int64, int64) { return mib, 1 })
	if v := s.verdict(short); len(v.checks) != 0 || v.note == "" {
		t.Errorf("a process with 8 samples after its warm-up was judged: %+v", v)
	}
}

// A log storm is more lines in a minute than the bound.
func TestSoakLogStorm(t *testing.T) {
	s := &soakStats{so: soakOptions{warmup: time.Minute, logStorm: 100}}
	p := series(30, func(int) (int64, int64) { return 1, 1 })
	for i := range p.samples {
		p.samples[i].logLines = 10 // 60 a minute
	}
	if v := s.verdict(p); v.logStorm || v.maxLogMin != 60 {
		t.Fatalf("60 lines a minute: storm %v, max %d", v.logStorm, v.maxLogMin)
	}
	p.samples[20].logLines = 500
	if v := s.verdict(p); !v.logStorm {
		t.Fatal("550 lines in a minute is no storm")
	}
}

// The parent is measured like the workers and judged on nothing: its
// bookkeeping grows by design.
func TestSoakParentNotJudged(t *testing.T) {
	s := &soakStats{so: soakOptions{warmup: 2 * time.Minute, heapGrowth: 30, heapFloor: 4, countMargin: 25, logStorm: 10}}
	p := series(60, func(i int) (int64, int64) { return int64(40+i) << 20, int64(1000 + 10*i) })
	p.parent = true
	p.samples[30].logLines = 500
	v := s.verdict(p)
	if len(v.checks) == 0 || !v.checks[0].rising || v.note == "" {
		t.Fatalf("parent: %+v", v)
	}
	if len(leaks(v)) > 0 || v.logStorm {
		t.Fatalf("the parent was judged: %+v", v)
	}
}
