package main

// What a soak run measures: latency histograms, the workers' runtime stats
// (reported on their stdout), and each process's file descriptors and
// connections (read from /proc).

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"runtime/metrics"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// histogram counts durations in buckets 10 % wide.
type histogram struct {
	n map[int]uint64
}

func newHistogram() *histogram { return &histogram{n: map[int]uint64{}} }

// bucket is the index of the bucket of d: [1.1^i, 1.1^(i+1)) µs.
func bucket(d time.Duration) int {
	us := float64(d) / float64(time.Microsecond)
	if us < 1 {
		us = 1
	}
	return int(math.Log(us) / math.Log(1.1))
}

func (h *histogram) add(d time.Duration) { h.n[bucket(d)]++ }

func (h *histogram) merge(o *histogram) {
	for i, c := range o.n {
		h.n[i] += c
	}
}

func (h *histogram) count() uint64 {
	var c uint64
	for _, n := range h.n {
		c += n
	}
	return c
}

// quantile is the upper bound of the bucket holding the q-quantile (0
// with no sample).
func (h *histogram) quantile(q float64) time.Duration {
	total := h.count()
	if total == 0 {
		return 0
	}
	idx := make([]int, 0, len(h.n))
	for i := range h.n {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	rank := uint64(math.Ceil(q * float64(total)))
	var seen uint64
	for _, i := range idx {
		if seen += h.n[i]; seen >= rank {
			return time.Duration(math.Pow(1.1, float64(i+1)) * float64(time.Microsecond))
		}
	}
	return 0
}

// encode is "i:n,i:n,...", what a worker prints.
func (h *histogram) encode() string {
	parts := make([]string, 0, len(h.n))
	for i, c := range h.n {
		parts = append(parts, strconv.Itoa(i)+":"+strconv.FormatUint(c, 10))
	}
	return strings.Join(parts, ",")
}

func decodeHistogram(s string) *histogram {
	h := newHistogram()
	for _, p := range strings.Split(s, ",") {
		i, c, ok := strings.Cut(p, ":")
		if !ok {
			continue
		}
		bi, err1 := strconv.Atoi(i)
		n, err2 := strconv.ParseUint(c, 10, 64)
		if err1 == nil && err2 == nil {
			h.n[bi] += n
		}
	}
	return h
}

// latencies are one front's latencies: of the current minute, and of the
// whole run. A nil *latencies records nothing.
type latencies struct {
	mu       sync.Mutex
	cur, all *histogram
}

func newLatencies() *latencies { return &latencies{cur: newHistogram(), all: newHistogram()} }

func (l *latencies) add(d time.Duration) {
	if l == nil {
		return
	}
	l.mu.Lock()
	l.cur.add(d)
	l.all.add(d)
	l.mu.Unlock()
}

func (l *latencies) merge(h *histogram) {
	if l == nil {
		return
	}
	l.mu.Lock()
	l.cur.merge(h)
	l.all.merge(h)
	l.mu.Unlock()
}

// take returns the current minute's histogram and starts a new one.
func (l *latencies) take() *histogram {
	l.mu.Lock()
	defer l.mu.Unlock()
	h := l.cur
	l.cur = newHistogram()
	return h
}

// workerStats is what a worker process reports in a soak run, every
// interval, on its stdout: "@stats heap=<live heap bytes>
// goroutines=<n> pgconns=<its pool's connections>", and "@lat <front>
// <histogram>" of the latencies it observed since its last report.
type workerStats struct {
	r    *reporter
	pool *pgxpool.Pool
	mu   sync.Mutex
	lat  map[string]*histogram
}

func newWorkerStats(r *reporter, pool *pgxpool.Pool) *workerStats {
	return &workerStats{r: r, pool: pool, lat: map[string]*histogram{}}
}

// observe records one latency of front.
func (s *workerStats) observe(front string, d time.Duration) {
	s.mu.Lock()
	h := s.lat[front]
	if h == nil {
		h = newHistogram()
		s.lat[front] = h
	}
	h.add(d)
	s.mu.Unlock()
}

// run reports every interval until ctx ends.
func (s *workerStats) run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		s.report()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *workerStats) report() {
	s.r.raw(fmt.Sprintf("@stats heap=%d goroutines=%d pgconns=%d", liveHeap(), runtime.NumGoroutine(), s.pool.Stat().TotalConns()))
	s.mu.Lock()
	lat := s.lat
	s.lat = map[string]*histogram{}
	s.mu.Unlock()
	for front, h := range lat {
		s.r.raw("@lat " + front + " " + h.encode())
	}
}

// liveHeap is the heap the last GC found live, in bytes: what leaks grow,
// without the garbage between two collections.
func liveHeap() int64 {
	m := []metrics.Sample{{Name: "/gc/heap/live:bytes"}}
	metrics.Read(m)
	if m[0].Value.Kind() == metrics.KindUint64 {
		return int64(m[0].Value.Uint64())
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// lineCounter counts the lines written through it.
type lineCounter struct {
	w io.Writer
	n *atomic.Int64
}

func (c lineCounter) Write(p []byte) (int, error) {
	c.n.Add(int64(strings.Count(string(p), "\n")))
	return c.w.Write(p)
}

// openFDs counts pid's open file descriptors (-1 when it cannot be read).
func openFDs(pid int) int {
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		return -1
	}
	return len(ents)
}

// tcpEstablished returns the inodes of the established TCP sockets (IPv4
// and IPv6) of this network namespace.
func tcpEstablished() map[string]bool {
	out := map[string]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			// sl local remote st tx:rx tr:when retrnsmt uid timeout inode
			if len(fs) > 9 && fs[3] == "01" {
				out[fs[9]] = true
			}
		}
	}
	return out
}

// openConns counts pid's file descriptors that are established TCP
// sockets (-1 when they cannot be read).
func openConns(pid int, established map[string]bool) int {
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return -1
	}
	n := 0
	for _, e := range ents {
		target, err := os.Readlink(dir + "/" + e.Name())
		if err != nil {
			continue
		}
		if inode, ok := strings.CutPrefix(target, "socket:["); ok && established[strings.TrimSuffix(inode, "]")] {
			n++
		}
	}
	return n
}
