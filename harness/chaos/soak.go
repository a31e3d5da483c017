package main

// The soak run (make soak): a day's work in an hour. Steady load on every
// front (Kafka through kafka-go and franz-go, NATS, HTTP, gRPC, and the two
// pipelines through the outbox and its relays) for -soak (default 1 h),
// on the services with a standby (a Postgres primary with a synchronous
// standby, Redis behind Sentinel, a three-node NATS cluster) and the
// services.sh Kafka, with one fault of a random kind every minute: every
// kind the chaos run knows, the failovers among them, drawn from a shuffled
// bag so that each kind comes once in every twelve faults. It stops by
// itself: at the end the producers stop, the faults stop, the run drains
// (every event must reach its effect) and is judged.
//
// Throughout, every -soak-sample, it samples each process: the workers
// report their live heap (after the last GC), goroutines and pool
// connections on their stdout; their open file descriptors and established
// TCP connections are read from /proc/<pid>; their log lines are counted;
// and Postgres's WAL position and the size of processed_events, outbox and
// effects. Each front's latency is the time from an event's sending to its
// effect (a consumer: from the broker's timestamp to the ledger's commit;
// HTTP and gRPC: the client's call with its retries; a pipeline: from the
// source's sending to B's commit). Every minute it prints a report; at the
// end it writes the whole as Markdown (docs/results/soak.md for a default
// run, soak-draft.md at the repository root otherwise).
//
// It fails on:
//   - any event lost or doubled, or any other violation of the chaos verdict;
//   - a leak. A measure leaks when it grows steadily after a warm-up: the
//     samples of a worker process's longest-lived incarnation, after its
//     first -soak-warmup, are cut in thirds; the medians of the thirds
//     must rise strictly (m1 < m2 < m3), and the last must be too high:
//     the live heap more than -soak-heap-growth percent and
//     -soak-heap-floor MiB above the first third's; goroutines, open file
//     descriptors and connections above their maximum during the warm-up by
//     more than -soak-count-margin percent of it (and at least 20
//     goroutines, 10 descriptors, 5 connections). A step (a pool filled by
//     a fault, once) raises one third, not all; a leak raises each. A
//     process needs 9 samples after its warm-up to be judged. The parent
//     process is reported, not judged: it holds the run's bookkeeping,
//     which grows by design (every answer its clients got), three embedded
//     NATS servers whose streams grow, and the fault proxies' sockets;
//   - a log storm: more than -soak-log-storm lines in a minute from one
//     process.

import (
	"context"
	"flag"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/benchresults"
)

// soakOptions are the soak run's flags.
type soakOptions struct {
	duration    time.Duration // 0: a chaos run
	rate        int           // events per second per front
	faultEvery  time.Duration
	sample      time.Duration
	warmup      time.Duration // 0: a fifth of the duration, at least 2 minutes
	drain       time.Duration
	report      string
	heapGrowth  float64 // percent
	heapFloor   float64 // MiB
	countMargin float64 // percent
	logStorm    int     // lines per minute per process
}

func (s *soakOptions) flags(fs *flag.FlagSet) {
	fs.DurationVar(&s.duration, "soak", 0, "run a soak of this long instead (make soak): steady load on every front, a fault of a random kind every -soak-fault-every, the processes and Postgres measured")
	fs.IntVar(&s.rate, "soak-rate", 20, "soak: events per second per front (HTTP and gRPC: requests per second; a third as many keys)")
	fs.DurationVar(&s.faultEvery, "soak-fault-every", time.Minute, "soak: one fault this often")
	fs.DurationVar(&s.sample, "soak-sample", 10*time.Second, "soak: sample the processes this often")
	fs.DurationVar(&s.warmup, "soak-warmup", 0, "soak: the warm-up left out of the leak checks (0: a fifth of -soak, at least 2 minutes)")
	fs.DurationVar(&s.drain, "soak-drain", 5*time.Minute, "soak: after the load, how long every event may take to reach its effect")
	fs.StringVar(&s.report, "soak-report", "", "soak: the Markdown report (default docs/results/soak.md for a 1 h run, soak-draft.md at the repository root otherwise)")
	fs.Float64Var(&s.heapGrowth, "soak-heap-growth", 30, "soak: a live heap growing steadily by more than this many percent leaks")
	fs.Float64Var(&s.heapFloor, "soak-heap-floor", 4, "soak: ... and by at least this many MiB")
	fs.Float64Var(&s.countMargin, "soak-count-margin", 25, "soak: goroutines, descriptors, connections growing steadily this many percent above their warm-up maximum leak")
	fs.IntVar(&s.logStorm, "soak-log-storm", 1000, "soak: more log lines than this in a minute from one process is a log storm")
}

// defaultSoak is the duration that writes docs/results/soak.md.
const defaultSoak = time.Hour

// soakFaults are the kinds a soak draws from.
var soakFaults = []string{fKill, fRelayKill, fRedis, fPgTerminate, fPgCrash, fKafkaCrash, fNatsRestart, fNet, fRelease,
	fPgFailover, fRedisFailover, fNatsLeader}

// soakRun is a soak run's driver and measures.
type soakRun struct {
	so    soakOptions
	stats *soakStats
}

// soak runs a soak and returns the exit code.
func soak(ctx context.Context, o options) int {
	so := o.soak
	if so.warmup == 0 {
		so.warmup = max(2*time.Minute, so.duration/5)
	}
	o = soakSizes(o)
	root, err := benchresults.RepoRoot(".")
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 2
	}
	logPath := filepath.Join(os.TempDir(), "justonce-soak-"+time.Now().Format("20060102-150405")+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 2
	}
	defer logFile.Close()
	stats := newSoakStats(so, logFile)
	errOut = stats.parent.logWriter()
	redis.SetLogger(redisLog{})
	sk := &soakRun{so: so, stats: stats}
	fmt.Printf("soak: %s, %d events/s per front, a fault every %s; workers' and services' logs in %s\n",
		so.duration, so.rate, so.faultEvery, logPath)
	br := benchresults.Begin(root)
	ctx, cancel := context.WithTimeout(ctx, so.duration+so.drain+15*time.Minute)
	defer cancel()
	sum, runErr := run(ctx, o, sk)
	br.End()
	sum.print(os.Stdout)
	path := so.report
	if path == "" {
		path = filepath.Join(root, "soak-draft.md")
		if so.duration == defaultSoak {
			path = filepath.Join(root, benchresults.ResultsDir, "soak.md")
		}
	}
	if err := sk.write(path, br, sum, runErr, logPath); err != nil {
		fmt.Fprintln(os.Stderr, "chaos: soak report:", err)
	} else {
		fmt.Printf("soak report: %s\n", path)
	}
	stats.printVerdict(os.Stdout, sum, runErr)
	if runErr != nil || sum.violations() > 0 {
		return 1
	}
	return 0
}

// redisLog sends go-redis's log lines (this process's clients') to errOut,
// where they are counted, as the workers' are.
type redisLog struct{}

func (redisLog) Printf(_ context.Context, format string, v ...any) {
	fmt.Fprintf(errOut, "redis: "+format+"\n", v...)
}

// soakSizes sets the run's sizes from the rate and duration, every front
// and the services with a standby on; the soak's own schedule injects the
// faults (the counts here only choose the services).
func soakSizes(o options) options {
	secs := int(o.soak.duration / time.Second)
	n := max(o.soak.rate*secs, 10)
	o.transports = "kafka,franz,nats,http,grpc"
	o.events, o.twoHop = n, n
	o.httpKeys, o.grpcKeys, o.twoHopHTTPKeys = max(n/3, 1), max(n/3, 1), max(n/3, 1)
	o.workers, o.hopWorkers, o.relays = 2, 1, 2
	o.kills, o.relayKills, o.redisOutages, o.pgTerminates, o.pgCrashes = 1, 1, 1, 1, 1
	o.kafkaCrashes, o.natsRestarts, o.netFaults, o.releases = 1, 1, 1, 1
	o.pgFailovers, o.redisFailovers, o.natsLeaderKills = 1, 1, 1
	o.janitor = true
	return o
}

// faultEvent is one fault of a soak, as the report lists it.
type faultEvent struct {
	at   time.Duration
	kind string
	took time.Duration
	err  string
}

// drive produces steadily for the duration with a fault every faultEvery,
// samples throughout, then lets every event reach its effect.
func (sk *soakRun) drive(ctx context.Context, e *env) error {
	st := sk.stats
	st.begin(e)
	sampleCtx, stopSampling := context.WithCancel(ctx)
	var sampling sync.WaitGroup
	sampling.Add(1)
	go func() { defer sampling.Done(); st.sampleLoop(sampleCtx, e) }()
	defer func() { stopSampling(); sampling.Wait(); st.finalSample(context.WithoutCancel(ctx), e) }()

	loadCtx, stopLoad := context.WithTimeout(ctx, sk.so.duration)
	defer stopLoad()
	var wg sync.WaitGroup
	errs := make(chan error, len(e.producers)+1)
	for _, p := range e.producers {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- sk.produce(loadCtx, ctx, e, p) }()
	}
	wg.Add(1)
	go func() { defer wg.Done(); errs <- sk.faultLoop(loadCtx, e) }()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return err
		}
	}
	fmt.Fprintf(os.Stdout, "soak: load done at %s; draining (at most %s)\n", st.since(), sk.so.drain)
	return sk.drainAll(ctx, e)
}

// produce emits p's plan evenly over the load's duration: every second,
// the share due by then. When the load ends, the rest of the plan goes
// at once (under ctx), so that the verdict has every event.
func (sk *soakRun) produce(load, ctx context.Context, e *env, p *producer) error {
	start := time.Now()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		frac := float64(time.Since(start)) / float64(sk.so.duration)
		due := min(len(p.ids), int(frac*float64(len(p.ids))))
		if load.Err() != nil {
			due = len(p.ids)
		}
		if due > p.next {
			if err := emitRetry(ctx, p, p.ids[p.next:due], &e.sum.producerRetries); err != nil {
				return fmt.Errorf("produce %s: %w", p.name, err)
			}
			p.next = due
		}
		if p.next == len(p.ids) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-load.Done():
		case <-t.C:
		}
	}
}

// faultLoop injects one fault every faultEvery until the load ends, its
// kind drawn from a shuffled bag of every kind; a kind that cannot be
// injected now is put back and the next one tried.
func (sk *soakRun) faultLoop(ctx context.Context, e *env) error {
	s := &schedule{e: e, faults: e.faults()}
	var bag []string
	t := time.NewTicker(sk.so.faultEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		for try := 0; try < 2*len(soakFaults); try++ {
			if len(bag) == 0 {
				bag = append(bag, soakFaults...)
				mrand.Shuffle(len(bag), func(i, j int) { bag[i], bag[j] = bag[j], bag[i] })
			}
			kind := bag[0]
			bag = bag[1:]
			at := time.Now()
			ok, err := s.inject(context.WithoutCancel(ctx), kind)
			if err != nil {
				sk.stats.fault(faultEvent{at: sk.stats.since(), kind: kind, took: time.Since(at), err: err.Error()})
				return fmt.Errorf("%s: %w", kind, err)
			}
			if ok {
				e.sum.asked[kind]++
				sk.stats.fault(faultEvent{at: at.Sub(sk.stats.start), kind: kind, took: time.Since(at)})
				break
			}
			bag = append(bag, kind)
		}
	}
}

// drainAll waits until every event reached its effect and every request
// was answered, for at most the drain time.
func (sk *soakRun) drainAll(ctx context.Context, e *env) error {
	ctx, cancel := context.WithTimeout(ctx, sk.so.drain)
	defer cancel()
	done := make(chan struct{})
	go func() { e.reqWG.Wait(); close(done) }()
	for {
		ok, state := e.complete(ctx, done)
		if ok {
			return nil
		}
		if err := consumer.Sleep(ctx, time.Second); err != nil {
			_, state = e.complete(context.WithoutCancel(ctx), done)
			return fmt.Errorf("soak: not every event reached its effect within %s of the load's end: %s", sk.so.drain, state)
		}
		_ = state
	}
}

// soakStats holds a soak's measures.
type soakStats struct {
	so     soakOptions
	every  time.Duration // the workers' report interval
	start  time.Time
	out    io.Writer // the log file
	parent *procStats

	mu         sync.Mutex
	procs      []*procStats
	fronts     map[string]*latencies
	frontOrder []string
	minutes    []minuteRow
	faults     []faultEvent
	pgLast     pgSample
	pgFirst    pgSample
}

func newSoakStats(so soakOptions, out io.Writer) *soakStats {
	s := &soakStats{so: so, every: so.sample, start: time.Now(), out: out, fronts: map[string]*latencies{}}
	s.parent = &procStats{name: "chaos (parent)", role: "parent", parent: true, out: out, soak: s}
	s.parent.started(os.Getpid())
	s.procs = append(s.procs, s.parent)
	for _, f := range []string{"kafka", "franz", "nats", "http", "grpc", pipeKN, pipeHK} {
		s.front(f)
	}
	return s
}

func (s *soakStats) since() time.Duration { return time.Since(s.start).Round(time.Second) }

// process returns the measures of a worker slot.
func (s *soakStats) process(name, role string) *procStats {
	p := &procStats{name: name, role: role, out: s.out, soak: s}
	s.mu.Lock()
	s.procs = append(s.procs, p)
	s.mu.Unlock()
	return p
}

// front returns a front's latencies. A nil *soakStats has none.
func (s *soakStats) front(name string) *latencies {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.fronts[name]
	if l == nil {
		l = newLatencies()
		s.fronts[name] = l
		s.frontOrder = append(s.frontOrder, name)
	}
	return l
}

func (s *soakStats) fault(f faultEvent) {
	s.mu.Lock()
	s.faults = append(s.faults, f)
	s.mu.Unlock()
	status := "healed in " + f.took.Round(100*time.Millisecond).String()
	if f.err != "" {
		status = "FAILED: " + f.err
	}
	fmt.Fprintf(os.Stdout, "soak %s  fault: %s, %s\n", clock(f.at), f.kind, status)
	fmt.Fprintf(s.out, "chaos: soak fault at %s: %s, %s\n", clock(f.at), f.kind, status)
}

// clock formats a time since the start as mm:ss.
func clock(d time.Duration) string {
	d = d.Round(time.Second)
	return fmt.Sprintf("%02d:%02d", int(d/time.Minute), int(d%time.Minute/time.Second))
}

// procStats is one process's measures in a soak run: the parent, or a
// worker slot across its restarts. A nil *procStats records nothing.
type procStats struct {
	name, role string
	parent     bool
	out        io.Writer
	soak       *soakStats
	logLines   atomic.Int64

	mu          sync.Mutex
	pid         int
	incarnation int
	heap        int64
	goroutines  int64
	pgConns     int64
	reported    bool // the current incarnation reported its stats
	lastLog     int64
	samples     []procSample
}

// procSample is one sample of a process; -1 is unknown.
type procSample struct {
	at                                    time.Duration
	incarnation                           int
	pid                                   int
	heap, goroutines, fds, conns, pgConns int64
	logLines                              int64 // since the previous sample
}

// started records a new incarnation of the process.
func (p *procStats) started(pid int) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.pid, p.reported = pid, false
	p.incarnation++
	p.mu.Unlock()
}

// logWriter counts the process's log lines on their way to the log file.
func (p *procStats) logWriter() io.Writer { return lineCounter{w: p.out, n: &p.logLines} }

// parse takes a worker's "@stats" and "@lat" lines; false for others.
func (p *procStats) parse(line string) bool {
	if rest, ok := strings.CutPrefix(line, "@stats "); ok {
		p.mu.Lock()
		for _, kv := range strings.Fields(rest) {
			k, v, _ := strings.Cut(kv, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			switch k {
			case "heap":
				p.heap = n
			case "goroutines":
				p.goroutines = n
			case "pgconns":
				p.pgConns = n
			}
		}
		p.reported = true
		p.mu.Unlock()
		return true
	}
	if rest, ok := strings.CutPrefix(line, "@lat "); ok {
		front, h, _ := strings.Cut(rest, " ")
		p.soak.front(front).merge(decodeHistogram(h))
		return true
	}
	return false
}

// sample takes one sample of the process.
func (p *procStats) sample(at time.Duration, established map[string]bool) procSample {
	logs := p.logLines.Load()
	p.mu.Lock()
	defer p.mu.Unlock()
	s := procSample{at: at, incarnation: p.incarnation, pid: p.pid, heap: -1, goroutines: -1, pgConns: -1,
		fds: int64(openFDs(p.pid)), conns: int64(openConns(p.pid, established)), logLines: logs - p.lastLog}
	p.lastLog = logs
	switch {
	case p.parent:
		s.heap, s.goroutines = liveHeap(), int64(runtimeGoroutines())
	case p.reported:
		s.heap, s.goroutines, s.pgConns = p.heap, p.goroutines, p.pgConns
	}
	p.samples = append(p.samples, s)
	return s
}

// sortedSamples returns a copy of the samples.
func (p *procStats) sortedSamples() []procSample {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := append([]procSample(nil), p.samples...)
	sort.Slice(out, func(i, j int) bool { return out[i].at < out[j].at })
	return out
}

// procList returns the processes, the parent first, then by name.
func (s *soakStats) procList() []*procStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	ps := append([]*procStats(nil), s.procs...)
	sort.SliceStable(ps, func(i, j int) bool {
		if ps[i].parent != ps[j].parent {
			return ps[i].parent
		}
		return ps[i].name < ps[j].name
	})
	return ps
}
