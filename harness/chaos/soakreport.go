package main

// The soak's sampling, minute reports, leak and log-storm verdict, and
// its Markdown report.

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"sort"
	"strings"
	"time"

	"github.com/justonce/justonce/harness/benchresults"
)

func runtimeGoroutines() int { return runtime.NumGoroutine() }

// pgSample is Postgres's WAL position and table sizes at one moment.
type pgSample struct {
	ok    bool
	at    time.Duration
	wal   int64            // bytes since LSN 0/0
	sizes map[string]int64 // table -> bytes, with indexes, TOAST and partitions
}

// soakTables are the tables whose size a soak follows.
var soakTables = []string{"processed_events", "outbox", "effects"}

// samplePG reads Postgres's WAL position and the tables' sizes (not ok
// when Postgres does not answer: a crash or a failover in progress).
func (s *soakStats) samplePG(ctx context.Context, e *env) pgSample {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	p := pgSample{at: time.Since(s.start), sizes: map[string]int64{}}
	if err := e.admin.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`).Scan(&p.wal); err != nil {
		return p
	}
	for _, t := range soakTables {
		var n int64
		if err := e.admin.QueryRow(ctx, `SELECT (pg_total_relation_size($1::regclass) + coalesce((SELECT sum(pg_total_relation_size(relid))
			FROM pg_partition_tree($1::regclass) WHERE relid <> $1::regclass), 0))::bigint`,
			e.schema+"."+t).Scan(&n); err != nil {
			return p
		}
		p.sizes[t] = n
	}
	p.ok = true
	return p
}

// minuteRow is one minute of a soak, as reported.
type minuteRow struct {
	at       time.Duration
	faults   []string
	p99      map[string]time.Duration
	n        map[string]uint64
	pg       pgSample
	walDelta int64 // WAL written since the previous row (-1: unknown)
	effects  int
	procs    []procSample // the last sample of each process, its log lines summed over the minute
	names    []string
}

// begin starts the measures once the fronts run.
func (s *soakStats) begin(e *env) {
	s.pgFirst = s.samplePG(context.Background(), e)
	s.pgLast = s.pgFirst
}

// sampleLoop samples every process every s.every and reports every
// minute, until ctx ends.
func (s *soakStats) sampleLoop(ctx context.Context, e *env) {
	t := time.NewTicker(s.every)
	defer t.Stop()
	next := time.Minute
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.sampleAll()
		if time.Since(s.start) >= next {
			s.minute(ctx, e)
			next += time.Minute
		}
	}
}

// finalSample samples once more and reports the last (partial) minute.
func (s *soakStats) finalSample(ctx context.Context, e *env) {
	s.sampleAll()
	s.minute(ctx, e)
}

func (s *soakStats) sampleAll() {
	at := time.Since(s.start)
	est := tcpEstablished()
	for _, p := range s.procList() {
		p.sample(at, est)
	}
}

// minute builds, prints and keeps the report of the minute just ended.
func (s *soakStats) minute(ctx context.Context, e *env) {
	at := time.Since(s.start)
	var from time.Duration
	s.mu.Lock()
	if n := len(s.minutes); n > 0 {
		from = s.minutes[n-1].at
	}
	var faults []string
	for _, f := range s.faults {
		if f.at >= from && f.at < at {
			faults = append(faults, f.kind)
		}
	}
	fronts := append([]string(nil), s.frontOrder...)
	s.mu.Unlock()
	r := minuteRow{at: at, faults: faults, p99: map[string]time.Duration{}, n: map[string]uint64{}, walDelta: -1}
	for _, f := range fronts {
		h := s.front(f).take()
		r.n[f], r.p99[f] = h.count(), h.quantile(0.99)
	}
	r.pg = s.samplePG(ctx, e)
	if r.pg.ok && s.pgLast.ok {
		r.walDelta = r.pg.wal - s.pgLast.wal
	}
	if r.pg.ok {
		s.pgLast = r.pg
	}
	if got, _, err := e.progress(ctx); err == nil {
		for _, n := range got {
			r.effects += n
		}
	}
	for _, p := range s.procList() {
		ss := p.sortedSamples()
		if len(ss) == 0 {
			continue
		}
		last := ss[len(ss)-1]
		last.logLines = 0
		for _, x := range ss {
			if x.at > from && x.at <= at {
				last.logLines += x.logLines
			}
		}
		r.procs = append(r.procs, last)
		r.names = append(r.names, p.name)
	}
	s.mu.Lock()
	s.minutes = append(s.minutes, r)
	s.mu.Unlock()
	s.printMinute(os.Stdout, r, fronts)
}

func (s *soakStats) printMinute(w io.Writer, r minuteRow, fronts []string) {
	faults := "none"
	if len(r.faults) > 0 {
		faults = strings.Join(r.faults, ", ")
	}
	fmt.Fprintf(w, "soak %s  faults this minute: %s; distinct effects so far %d\n", clock(r.at), faults, r.effects)
	var ps []string
	for _, f := range fronts {
		if r.n[f] > 0 {
			ps = append(ps, fmt.Sprintf("%s %s (%d)", f, r.p99[f].Round(time.Millisecond), r.n[f]))
		}
	}
	fmt.Fprintf(w, "  p99 sent to effect: %s\n", strings.Join(ps, ", "))
	fmt.Fprintf(w, "  postgres: %s\n", pgLine(r))
	fmt.Fprintf(w, "  %-16s %7s %9s %10s %5s %6s %8s %8s\n", "process", "pid", "heap", "goroutines", "fds", "conns", "pgconns", "log/min")
	for i, p := range r.procs {
		fmt.Fprintf(w, "  %-16s %7d %9s %10s %5s %6s %8s %8d\n", r.names[i], p.pid, mib(p.heap), num(p.goroutines), num(p.fds), num(p.conns), num(p.pgConns), p.logLines)
	}
}

func pgLine(r minuteRow) string {
	if !r.pg.ok {
		return "did not answer"
	}
	wal := "?"
	if r.walDelta >= 0 {
		wal = mib(r.walDelta)
	}
	var sizes []string
	for _, t := range soakTables {
		sizes = append(sizes, fmt.Sprintf("%s %s", t, mib(r.pg.sizes[t])))
	}
	return fmt.Sprintf("WAL %s this minute; %s", wal, strings.Join(sizes, ", "))
}

func mib(b int64) string {
	if b < 0 {
		return "-"
	}
	return fmt.Sprintf("%.1fMiB", float64(b)/(1<<20))
}

func num(n int64) string {
	if n < 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

// leakCheck is one measure of one process, judged.
type leakCheck struct {
	measure        string
	warmMax        float64
	m1, m2, m3     float64
	leak           bool
	rising, judged bool
}

// procVerdict is one process's verdict.
type procVerdict struct {
	name       string
	restarts   int
	note       string // why it was not judged, or on what
	checks     []leakCheck
	maxLogMin  int64
	logStorm   bool
	judgedSpan string
}

// judge adds the leaks and log storms to the run's violations.
func (sk *soakRun) judge(_ context.Context, e *env) {
	for _, v := range sk.stats.verdicts() {
		for _, c := range v.checks {
			if c.leak {
				e.sum.problem("soak: %s leaks %s: medians of the thirds after its warm-up %s, %s, %s (warm-up maximum %s)",
					v.name, c.measure, c.fmt(c.m1), c.fmt(c.m2), c.fmt(c.m3), c.fmt(c.warmMax))
			}
		}
		if v.logStorm {
			e.sum.problem("soak: %s logged %d lines in a minute (log storm: more than %d)", v.name, v.maxLogMin, sk.so.logStorm)
		}
	}
}

func (c leakCheck) fmt(v float64) string {
	if c.measure == "heap" {
		return mib(int64(v))
	}
	return fmt.Sprintf("%.0f", v)
}

// verdicts judges every process (see soak.go for the definitions).
func (s *soakStats) verdicts() []procVerdict {
	var out []procVerdict
	for _, p := range s.procList() {
		out = append(out, s.verdict(p))
	}
	return out
}

func (s *soakStats) verdict(p *procStats) procVerdict {
	ss := p.sortedSamples()
	v := procVerdict{name: p.name}
	// Log storms: per minute of the run, every process.
	perMin := map[int]int64{}
	for _, x := range ss {
		perMin[int(x.at/time.Minute)] += x.logLines
	}
	for _, n := range perMin {
		v.maxLogMin = max(v.maxLogMin, n)
	}
	v.logStorm = v.maxLogMin > int64(s.so.logStorm)
	byInc := map[int][]procSample{}
	for _, x := range ss {
		byInc[x.incarnation] = append(byInc[x.incarnation], x)
	}
	v.restarts = len(byInc) - 1
	var inc []procSample
	for _, xs := range byInc {
		if len(xs) > len(inc) {
			inc = xs
		}
	}
	if len(inc) == 0 {
		v.note = "no sample"
		return v
	}
	start := inc[0].at
	var warm, after []procSample
	for _, x := range inc {
		if x.at-start < s.so.warmup {
			warm = append(warm, x)
		} else {
			after = append(after, x)
		}
	}
	if len(after) < 9 {
		v.note = fmt.Sprintf("not judged: %d samples after its warm-up (9 needed)", len(after))
		return v
	}
	v.judgedSpan = fmt.Sprintf("%s–%s", clock(after[0].at), clock(after[len(after)-1].at))
	for _, m := range []struct {
		name  string
		get   func(procSample) int64
		floor float64
	}{
		{"heap", func(x procSample) int64 { return x.heap }, s.so.heapFloor * (1 << 20)},
		{"goroutines", func(x procSample) int64 { return x.goroutines }, 20},
		{"fds", func(x procSample) int64 { return x.fds }, 10},
		{"conns", func(x procSample) int64 { return x.conns }, 5},
	} {
		v.checks = append(v.checks, s.leak(m.name, warm, after, m.get, m.floor))
	}
	if p.parent {
		// Measured like the others, judged on nothing: see soak.go.
		for i := range v.checks {
			v.checks[i].leak = false
		}
		v.logStorm = false
		v.note = "reported, not judged (see soak.go)"
	}
	return v
}

// leak judges one measure: see soak.go.
func (s *soakStats) leak(name string, warm, after []procSample, get func(procSample) int64, floor float64) leakCheck {
	c := leakCheck{measure: name}
	var xs []float64
	for _, x := range after {
		if v := get(x); v >= 0 {
			xs = append(xs, float64(v))
		}
	}
	for _, x := range warm {
		if v := get(x); v >= 0 {
			c.warmMax = max(c.warmMax, float64(v))
		}
	}
	if len(xs) < 9 {
		return c
	}
	c.judged = true
	n := len(xs) / 3
	c.m1, c.m2, c.m3 = median(xs[:n]), median(xs[n:len(xs)-n]), median(xs[len(xs)-n:])
	c.rising = c.m1 < c.m2 && c.m2 < c.m3
	if name == "heap" {
		c.leak = c.rising && c.m3 > c.m1*(1+s.so.heapGrowth/100) && c.m3-c.m1 >= floor
	} else {
		c.leak = c.rising && c.m3 > c.warmMax+max(floor, c.warmMax*s.so.countMargin/100)
	}
	return c
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// printVerdict prints the soak's verdict lines.
func (s *soakStats) printVerdict(w io.Writer, sum *summary, runErr error) {
	leaks, storms, judged := 0, 0, 0
	for _, v := range s.verdicts() {
		if len(v.checks) > 0 && v.note == "" {
			judged++
		}
		for _, c := range v.checks {
			if c.leak {
				leaks++
			}
		}
		if v.logStorm {
			storms++
		}
	}
	fmt.Fprintf(w, "soak verdict: %d faults injected; %d processes judged for leaks: %d leaks, %d log storms; violations %d",
		len(s.faults), judged, leaks, storms, sum.violations())
	if runErr != nil {
		fmt.Fprintf(w, "; run error: %v", runErr)
	}
	fmt.Fprintln(w)
}

// write writes the Markdown report.
func (sk *soakRun) write(path string, br benchresults.Run, sum *summary, runErr error, logPath string) error {
	br.Title = "Soak run"
	if sk.so.duration != defaultSoak {
		br.Draft = fmt.Sprintf("a %s soak (the report meant for the docs comes from the default %s)", sk.so.duration, defaultSoak)
	}
	br.Command = os.Getenv("SOAK_COMMAND")
	if br.Command == "" {
		br.Command = "go run ./harness/chaos " + strings.Join(os.Args[1:], " ")
	}
	br.Commands = []string{"go run ./harness/chaos " + strings.Join(os.Args[1:], " ")}
	br.Knobs = benchresults.Knobs(os.Environ(), "SOAK_*", "JUSTONCE_*")
	br.Notes = append(br.Notes, fmt.Sprintf("the workers' and services' logs: `%s`", logPath))
	return benchresults.WriteFile(path, br, func(w io.Writer) error {
		var b strings.Builder
		sk.writeVerdict(&b, sum, runErr)
		sk.writeFaults(&b)
		sk.writeMinutes(&b)
		sk.writeProcs(&b)
		sk.writeSeries(&b)
		b.WriteString("### The chaos summary\n\n```\n")
		sum.print(&b)
		b.WriteString("```\n")
		_, err := io.WriteString(w, b.String())
		return err
	})
}

func (sk *soakRun) writeVerdict(b *strings.Builder, sum *summary, runErr error) {
	s := sk.stats
	fmt.Fprintf(b, "### Verdict\n\n")
	if runErr == nil && sum.violations() == 0 {
		b.WriteString("**Passed**: no event lost or doubled, no leak, no log storm.\n\n")
	} else {
		b.WriteString("**Failed**:\n\n")
		if runErr != nil {
			fmt.Fprintf(b, "- the run stopped: %v\n", runErr)
		}
		for _, p := range sum.problems {
			fmt.Fprintf(b, "- %s\n", p)
		}
		b.WriteString("\n")
	}
	fmt.Fprintf(b, "%s of load at %d events/s per front, a fault every %s (%d in all), sampled every %s; warm-up %s; "+
		"leak thresholds: live heap +%.0f %% and +%.0f MiB, counts +%.0f %% over the warm-up maximum; log storm above %d lines a minute. "+
		"Services with a standby: %s.\n\n",
		sk.so.duration, sk.so.rate, sk.so.faultEvery, len(s.faults), sk.so.sample, sk.so.warmup,
		sk.so.heapGrowth, sk.so.heapFloor, sk.so.countMargin, sk.so.logStorm, sum.haServices())
}

func (sk *soakRun) writeFaults(b *strings.Builder) {
	s := sk.stats
	t := benchresults.Table{Heading: "### Faults", Columns: []string{"at", "fault", "injected and healed in"}, Right: []bool{true, false, true}}
	for _, f := range s.faults {
		took := f.took.Round(100 * time.Millisecond).String()
		if f.err != "" {
			took = "failed: " + f.err
		}
		t.Rows = append(t.Rows, []string{clock(f.at), f.kind, took})
	}
	_ = t.Markdown(b)
}

func (sk *soakRun) writeMinutes(b *strings.Builder) {
	s := sk.stats
	cols := []string{"minute", "faults", "effects"}
	right := []bool{true, false, true}
	for _, f := range s.frontOrder {
		cols = append(cols, "p99 "+f)
		right = append(right, true)
	}
	cols = append(cols, "WAL", "processed_events", "outbox", "effects table", "max log/min")
	right = append(right, true, true, true, true, true)
	t := benchresults.Table{Heading: "### Minute by minute", Columns: cols, Right: right,
		Before: []string{"p99 is from an event's sending to its effect (in brackets: effects measured that minute); WAL is what Postgres wrote that minute; sizes include indexes, TOAST and partitions; log/min is the most any process logged that minute."}}
	for _, r := range s.minutes {
		row := []string{clock(r.at), strings.Join(r.faults, ", "), fmt.Sprint(r.effects)}
		for _, f := range s.frontOrder {
			row = append(row, fmt.Sprintf("%s (%d)", r.p99[f].Round(time.Millisecond), r.n[f]))
		}
		wal := "-"
		if r.walDelta >= 0 {
			wal = mib(r.walDelta)
		}
		row = append(row, wal)
		for _, tb := range soakTables {
			if r.pg.ok {
				row = append(row, mib(r.pg.sizes[tb]))
			} else {
				row = append(row, "-")
			}
		}
		var maxLog int64
		for _, p := range r.procs {
			maxLog = max(maxLog, p.logLines)
		}
		row = append(row, fmt.Sprint(maxLog))
		t.Rows = append(t.Rows, row)
	}
	var all []string
	for _, f := range s.frontOrder {
		h := s.front(f).all
		all = append(all, fmt.Sprintf("%s p50 %s, p99 %s, max bucket %s (%d effects)", f,
			h.quantile(0.5).Round(time.Millisecond), h.quantile(0.99).Round(time.Millisecond), h.quantile(1).Round(time.Millisecond), h.count()))
	}
	t.After = []string{"Over the whole run: " + strings.Join(all, "; ") + "."}
	_ = t.Markdown(b)
}

func (sk *soakRun) writeProcs(b *strings.Builder) {
	s := sk.stats
	t := benchresults.Table{Heading: "### Processes", Columns: []string{"process", "restarts", "judged on", "heap (warm-up max; thirds' medians)",
		"goroutines", "fds", "conns", "max log/min", "verdict"}, Right: []bool{false, true, false, false, false, false, false, true, false}}
	for _, v := range s.verdicts() {
		row := []string{v.name, fmt.Sprint(v.restarts), v.judgedSpan}
		verdict := "ok"
		if v.note != "" {
			verdict = v.note
		}
		for _, c := range v.checks {
			cell := "-"
			if c.judged {
				cell = fmt.Sprintf("%s; %s, %s, %s", c.fmt(c.warmMax), c.fmt(c.m1), c.fmt(c.m2), c.fmt(c.m3))
			}
			row = append(row, cell)
			if c.leak {
				verdict = "**leak: " + c.measure + "**"
			}
		}
		for len(row) < 7 {
			row = append(row, "-")
		}
		if v.logStorm {
			verdict = "**log storm**"
		}
		row = append(row, fmt.Sprint(v.maxLogMin), verdict)
		t.Rows = append(t.Rows, row)
	}
	_ = t.Markdown(b)
}

// writeSeries writes every process's samples, one line per measure.
func (sk *soakRun) writeSeries(b *strings.Builder) {
	s := sk.stats
	b.WriteString("### Every process, minute by minute\n\n")
	b.WriteString("The last sample of each minute (heap in MiB; `-`: not reported yet; `|` marks a restart).\n\n```\n")
	for _, p := range s.procList() {
		fmt.Fprintf(b, "%s\n", p.name)
		var heap, gor, fds, conns, pg, logs []string
		last := -1
		var logSum int64
		ss := p.sortedSamples()
		for i, x := range ss {
			logSum += x.logLines
			if i+1 < len(ss) && ss[i+1].at/time.Minute == x.at/time.Minute {
				continue
			}
			mark := ""
			if last >= 0 && x.incarnation != last {
				mark = "|"
			}
			last = x.incarnation
			heap = append(heap, mark+strings.TrimSuffix(mib(x.heap), "MiB"))
			gor = append(gor, mark+num(x.goroutines))
			fds = append(fds, mark+num(x.fds))
			conns = append(conns, mark+num(x.conns))
			pg = append(pg, mark+num(x.pgConns))
			logs = append(logs, mark+fmt.Sprint(logSum))
			logSum = 0
		}
		fmt.Fprintf(b, "  heap       %s\n  goroutines %s\n  fds        %s\n  conns      %s\n  pgconns    %s\n  log lines  %s\n",
			strings.Join(heap, " "), strings.Join(gor, " "), strings.Join(fds, " "), strings.Join(conns, " "), strings.Join(pg, " "), strings.Join(logs, " "))
	}
	b.WriteString("```\n\n")
}
