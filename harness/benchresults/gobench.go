package benchresults

import (
	"bufio"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// GoBench is what a log of `go test -bench` runs holds: the benchmarks'
// metrics per area, over one or several rounds.
//
// The log is go test's output, as scripts/bench.sh writes it to bench.out:
// each area's run is preceded by a marker line
//
//	== ./inbox (round 2 of 3): go test -run '^$' -bench . ./inbox
//
// (the round and the command are optional). Without markers, each
// package (go test's "pkg:" line) is an area of one round.
type GoBench struct {
	Areas []*Area // in the order of their first run
}

// Area is one package's benchmarks.
type Area struct {
	Name    string // as the marker names it (./inbox), else the package path
	Package string // go test's "pkg:" line
	Command string // the go test command, from the marker
	// Rounds is the number of rounds the log announced (the marker's
	// "of N"), at least the number of runs seen.
	Rounds int
	// Took is each run's time, from go test's closing "ok" or "FAIL" line.
	Took       []time.Duration
	Benchmarks []*Benchmark // in the order of their first result
	// Failures says what failed: a run's closing FAIL, a panic, a
	// benchmark's --- FAIL.
	Failures []string

	runs  int
	round int // of the run being read
}

// Benchmark is one benchmark's results over the rounds.
type Benchmark struct {
	Name    string   // without go test's -GOMAXPROCS suffix
	Units   []string // in the order go test printed them
	Samples map[string][]float64
	// Skipped is the reason of a --- SKIP, when the benchmark was skipped.
	Skipped string
}

var (
	markerRe  = regexp.MustCompile(`^== (\S+)(?: \(round (\d+) of (\d+)\))?(?:: (.*))?$`)
	procsRe   = regexp.MustCompile(`-\d+$`)
	itersRe   = regexp.MustCompile(`(?:^|\s)\d+\s*$`)
	closingRe = regexp.MustCompile(`^(ok|FAIL)\s+(\S+)\s+(\d+(?:\.\d+)?s)`)
)

// ParseGoBench reads a log of go test -bench runs.
func ParseGoBench(r io.Reader) (*GoBench, error) {
	g := &GoBench{}
	byName := map[string]*Area{}
	var area *Area
	var pending string      // a benchmark whose results have not come yet
	var indented string     // the last indented line since a benchmark's name (go test -v logs before --- SKIP)
	var reasonOf *string    // where the indented lines after --- SKIP/FAIL go
	var failedBench *string // the message of a --- FAIL being read
	areaFor := func(name string) *Area {
		a := byName[name]
		if a == nil {
			a = &Area{Name: name}
			byName[name] = a
			g.Areas = append(g.Areas, a)
		}
		return a
	}
	startRun := func(a *Area, round int) {
		a.runs++
		a.round = round
		if round == 0 {
			a.round = a.runs
		}
		a.Rounds = max(a.Rounds, a.round)
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 4<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "    ") && reasonOf == nil && failedBench == nil {
			indented = strings.TrimSpace(line)
		}
		if reasonOf != nil || failedBench != nil {
			if strings.HasPrefix(line, "    ") {
				msg := strings.TrimSpace(line)
				if reasonOf != nil && *reasonOf == "" {
					*reasonOf = msg
				}
				if failedBench != nil && !strings.Contains(*failedBench, ": ") {
					*failedBench += ": " + msg
				}
				continue
			}
			reasonOf, failedBench = nil, nil
		}
		if m := markerRe.FindStringSubmatch(line); m != nil {
			area = areaFor(m[1])
			round, _ := strconv.Atoi(m[2])
			of, _ := strconv.Atoi(m[3])
			startRun(area, round)
			area.Rounds = max(area.Rounds, of)
			if m[4] != "" {
				area.Command = m[4]
			}
			pending = ""
			continue
		}
		if pkg, ok := strings.CutPrefix(line, "pkg: "); ok {
			if area == nil || (area.Package != "" && area.Package != pkg) {
				// No marker: the package is the area, one run per package line.
				area = areaFor(pkg)
				startRun(area, 0)
			}
			area.Package = pkg
			continue
		}
		if area == nil {
			continue
		}
		if m := closingRe.FindStringSubmatch(line); m != nil {
			if d, err := time.ParseDuration(m[3]); err == nil {
				area.Took = append(area.Took, d)
			}
			if m[1] == "FAIL" {
				area.fail(fmt.Sprintf("%s exited with FAIL", m[2]))
			}
			continue
		}
		if strings.HasPrefix(line, "FAIL\t") && strings.Contains(line, "[build failed]") ||
			strings.HasPrefix(line, "panic: ") || strings.HasPrefix(line, "*** Test killed") {
			area.fail(line)
			continue
		}
		if rest, ok := strings.CutPrefix(line, "--- SKIP: "); ok {
			fs := strings.Fields(rest)
			if len(fs) == 0 {
				continue
			}
			b := area.benchmark(procsRe.ReplaceAllString(fs[0], ""))
			b.Skipped = ""
			if pending == b.Name {
				b.Skipped = indented
			}
			reasonOf = &b.Skipped
			continue
		}
		if rest, ok := strings.CutPrefix(line, "--- FAIL: "); ok {
			f := rest
			if fs := strings.Fields(rest); len(fs) > 0 {
				f = procsRe.ReplaceAllString(fs[0], "")
			}
			msg := fmt.Sprintf("%s failed%s", f, area.inRound())
			if pending == f && indented != "" {
				msg += ": " + indented
			}
			area.Failures = append(area.Failures, msg)
			failedBench = &area.Failures[len(area.Failures)-1]
			continue
		}
		if strings.HasPrefix(line, "Benchmark") {
			indented = ""
			name, rest, _ := strings.Cut(line, "\t")
			name = strings.TrimSpace(name)
			if strings.ContainsAny(name, " ") {
				name = strings.Fields(name)[0]
			}
			name = procsRe.ReplaceAllString(name, "")
			if metrics, ok := resultTail(rest); ok {
				area.add(name, metrics)
				pending = ""
			} else {
				pending = name
			}
			continue
		}
		if pending != "" {
			if metrics, ok := resultTail(line); ok {
				area.add(pending, metrics)
				pending = ""
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for _, a := range g.Areas {
		a.Rounds = max(a.Rounds, a.runs)
	}
	return g, nil
}

func (a *Area) inRound() string {
	if a.Rounds > 1 {
		return fmt.Sprintf(" in round %d", a.round)
	}
	return ""
}

func (a *Area) fail(msg string) {
	a.Failures = append(a.Failures, msg+a.inRound())
}

func (a *Area) benchmark(name string) *Benchmark {
	for _, b := range a.Benchmarks {
		if b.Name == name {
			return b
		}
	}
	b := &Benchmark{Name: name, Samples: map[string][]float64{}}
	a.Benchmarks = append(a.Benchmarks, b)
	return b
}

type metric struct {
	unit  string
	value float64
}

func (a *Area) add(name string, ms []metric) {
	b := a.benchmark(name)
	for _, m := range ms {
		if _, ok := b.Samples[m.unit]; !ok {
			b.Units = append(b.Units, m.unit)
		}
		b.Samples[m.unit] = append(b.Samples[m.unit], m.value)
	}
}

// resultTail reads the results go test prints after a benchmark's name:
// the iterations, then tab-separated "value unit" pairs. Output the
// benchmark printed itself may stand before them on the line.
func resultTail(s string) ([]metric, bool) {
	fields := strings.Split(s, "\t")
	var ms []metric
	i := len(fields) - 1
	for ; i >= 0; i-- {
		f := strings.Fields(fields[i])
		if len(f) != 2 {
			break
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			break
		}
		ms = append(ms, metric{unit: f[1], value: v})
	}
	if len(ms) == 0 || i < 0 || !itersRe.MatchString(fields[i]) {
		return nil, false
	}
	slices.Reverse(ms)
	return ms, true
}

// IsRatio says whether a metric is a ratio: its unit names one ("ratio",
// "p99-ratio") or divides one quantity by another ("wrapped/bare"), not by
// a unit of time or of work ("ops/s", "ns/op", "heap-B/in-flight").
func IsRatio(unit string) bool {
	if strings.Contains(unit, "ratio") {
		return true
	}
	i := strings.LastIndex(unit, "/")
	if i < 0 {
		return false
	}
	switch unit[i+1:] {
	case "s", "op", "call", "msg", "event", "in-flight", "row", "day":
		return false
	}
	return true
}

// Tables returns one table per area: each benchmark's ratios first, then
// its raw metrics; with several rounds, each value's median and its range
// over the rounds.
func (g *GoBench) Tables() []Table {
	var out []Table
	for _, a := range g.Areas {
		out = append(out, a.table())
	}
	return out
}

func (a *Area) table() Table {
	t := Table{Heading: "### " + a.Name}
	var about []string
	if a.Command != "" {
		about = append(about, "`"+a.Command+"`")
	}
	if a.Package != "" && a.Package != a.Name {
		about = append(about, "package `"+a.Package+"`")
	}
	if len(a.Took) > 0 {
		took := make([]string, len(a.Took))
		for i, d := range a.Took {
			if d < time.Minute {
				took[i] = d.Round(100 * time.Millisecond).String()
			} else {
				took[i] = d.Round(time.Second).String()
			}
		}
		w := "took " + strings.Join(took, ", ")
		if len(a.Took) > 1 {
			w += " (one per round)"
		}
		about = append(about, w)
	}
	if len(about) > 0 {
		t.Before = append(t.Before, strings.Join(about, "; ")+".")
	}
	if len(a.Failures) > 0 {
		t.Before = append(t.Before, "**Failed**: "+strings.Join(a.Failures, "; ")+". The values below are those of the runs that got that far.")
	}
	rounds := a.Rounds
	if rounds > 1 {
		t.Columns = []string{"benchmark", "metric", "median", fmt.Sprintf("range over %d rounds", rounds)}
		t.Right = []bool{false, false, true, true}
	} else {
		t.Columns = []string{"benchmark", "metric", "value"}
		t.Right = []bool{false, false, true}
	}
	for _, b := range a.Benchmarks {
		name := b.Name
		if b.Skipped != "" || len(b.Units) == 0 {
			why := "skipped"
			if b.Skipped != "" {
				why += ": " + b.Skipped
			}
			t.Rows = append(t.Rows, []string{name, why})
			continue
		}
		units := slices.Clone(b.Units)
		slices.SortStableFunc(units, func(x, y string) int {
			switch rx, ry := IsRatio(x), IsRatio(y); {
			case rx && !ry:
				return -1
			case ry && !rx:
				return 1
			}
			return 0
		})
		for _, u := range units {
			format := FormatValue
			if IsRatio(u) {
				format = FormatRatio
			}
			s := Summarize(b.Samples[u])
			row := []string{name, u, format(s.Median)}
			if rounds > 1 {
				r := s.Range(format)
				if s.N < rounds {
					r += fmt.Sprintf(" (%d of %d rounds)", s.N, rounds)
				}
				row = append(row, r)
			}
			t.Rows = append(t.Rows, row)
			name = ""
		}
	}
	if len(a.Benchmarks) == 0 {
		t.After = append(t.After, "No benchmark result.")
	}
	return t
}

// Commands returns the areas' commands, in order, without repeats.
func (g *GoBench) Commands() []string {
	var out []string
	for _, a := range g.Areas {
		if a.Command != "" && !slices.Contains(out, a.Command) {
			out = append(out, a.Command)
		}
	}
	return out
}

// Failed says whether any area failed.
func (g *GoBench) Failed() bool {
	for _, a := range g.Areas {
		if len(a.Failures) > 0 {
			return true
		}
	}
	return false
}
