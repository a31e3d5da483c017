package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

// observations counts what the workers reported ("@ev <name>" lines) and
// how long restarted workers took to their first effect.
type observations struct {
	mu        sync.Mutex
	counts    map[string]int
	restarts  []time.Duration // restart to first effect
	restarted int             // restarts after a kill or a crash
	crashes   int             // workers that exited on their own
}

func (o *observations) add(ev string) {
	o.mu.Lock()
	o.counts[ev]++
	o.mu.Unlock()
}

func (o *observations) get(ev string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.counts[ev]
}

// percentile of the restart-to-first-effect times (p in 0..1).
func (o *observations) restartStats() (n, of int, p50, pmax time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	d := append([]time.Duration(nil), o.restarts...)
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	if len(d) > 0 {
		p50, pmax = d[len(d)/2], d[len(d)-1]
	}
	return len(d), o.restarted, p50, pmax
}

// lineWriter parses a worker's stdout: "@ev" lines are observations, the
// rest goes to stderr.
type lineWriter struct {
	buf     []byte
	obs     *observations
	started time.Time
	restart bool
	seen    bool
	stats   *procStats // a soak run's: "@stats" and "@lat" lines, log lines (nil: a chaos run)
	log     io.Writer  // where the other lines go
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		line := string(w.buf[:i])
		w.buf = w.buf[i+1:]
		if w.stats != nil && w.stats.parse(line) {
			continue
		}
		ev, ok := strings.CutPrefix(line, "@ev ")
		if !ok {
			fmt.Fprintln(w.log, line)
			continue
		}
		w.obs.add(ev)
		if ev == "first-effect" && w.restart && !w.seen {
			w.seen = true
			w.obs.mu.Lock()
			w.obs.restarts = append(w.obs.restarts, time.Since(w.started))
			w.obs.mu.Unlock()
		}
	}
	return len(p), nil
}

// slot supervises one consumer process: restarts it when it dies.
type slot struct {
	transport, name string
	args            []string
	mu              sync.Mutex
	cmd             *exec.Cmd
	killed          bool
	stopping        bool
	done            chan struct{}
	stats           *procStats // a soak run's measures of the process (nil: a chaos run)
}

func (s *slot) supervise(obs *observations) {
	defer close(s.done)
	for n := 0; ; n++ {
		cmd, err := self(append(s.args, "-name", s.name)...)
		if err != nil {
			fmt.Fprintln(errOut, "chaos: worker:", err)
			return
		}
		lw := &lineWriter{obs: obs, started: time.Now(), restart: n > 0, log: os.Stderr, stats: s.stats}
		if s.stats != nil {
			lw.log = s.stats.logWriter()
			cmd.Stderr = lw.log
		}
		cmd.Stdout = lw
		if n > 0 {
			obs.mu.Lock()
			obs.restarted++
			obs.mu.Unlock()
		}
		s.mu.Lock()
		if s.stopping {
			s.mu.Unlock()
			return
		}
		err = cmd.Start()
		if err == nil {
			s.cmd, s.killed = cmd, false
			s.stats.started(cmd.Process.Pid)
		}
		s.mu.Unlock()
		if err != nil {
			fmt.Fprintln(errOut, "chaos: start worker:", err)
			time.Sleep(200 * time.Millisecond)
			continue
		}
		_ = cmd.Wait()
		s.mu.Lock()
		stopping, killed := s.stopping, s.killed
		s.cmd = nil
		s.mu.Unlock()
		if stopping {
			return
		}
		if !killed {
			obs.mu.Lock()
			obs.crashes++
			obs.mu.Unlock()
			time.Sleep(200 * time.Millisecond)
		}
	}
}

func (s *slot) kill() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil || s.cmd.Process == nil || s.stopping || s.killed {
		return false
	}
	s.killed = true
	return s.cmd.Process.Signal(syscall.SIGKILL) == nil
}

// signal sends sig to the running process, unless it was killed (or is
// being stopped, for any signal but SIGCONT).
func (s *slot) signal(sig syscall.Signal) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil || s.cmd.Process == nil || s.killed || (s.stopping && sig != syscall.SIGCONT) {
		return false
	}
	return s.cmd.Process.Signal(sig) == nil
}

func (s *slot) stop() {
	s.mu.Lock()
	s.stopping = true
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
	}
	s.mu.Unlock()
	select {
	case <-s.done:
	case <-time.After(30 * time.Second):
		s.mu.Lock()
		if s.cmd != nil && s.cmd.Process != nil {
			_ = s.cmd.Process.Kill()
		}
		s.mu.Unlock()
		<-s.done
	}
}
