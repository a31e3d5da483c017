package benchresults

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

func parseFile(t *testing.T, name string) *GoBench {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g, err := ParseGoBench(f)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func area(t *testing.T, g *GoBench, name string) *Area {
	t.Helper()
	for _, a := range g.Areas {
		if a.Name == name {
			return a
		}
	}
	t.Fatalf("no area %s among %d", name, len(g.Areas))
	return nil
}

func bench(t *testing.T, a *Area, name string) *Benchmark {
	t.Helper()
	for _, b := range a.Benchmarks {
		if b.Name == name {
			return b
		}
	}
	t.Fatalf("%s: no benchmark %s", a.Name, name)
	return nil
}

// golden compares got with testdata/name, or rewrites it under -update.
func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs (go test -run %s -update rewrites it):\n%s", path, t.Name(), got)
	}
}

func markdown(t *testing.T, g *GoBench) []byte {
	t.Helper()
	var b bytes.Buffer
	for _, tb := range g.Tables() {
		if err := tb.Markdown(&b); err != nil {
			t.Fatal(err)
		}
	}
	return b.Bytes()
}

// A one-round log of scripts/bench.sh (JUSTONCE_BENCH_SMALL=1, six areas,
// written before the markers named rounds and commands).
func TestParseOneRound(t *testing.T) {
	g := parseFile(t, "small-one-round.txt")
	var names []string
	for _, a := range g.Areas {
		names = append(names, a.Name)
		if a.Rounds != 1 || len(a.Took) != 1 || len(a.Failures) != 0 {
			t.Errorf("%s: %d rounds, took %v, failures %q; want one round, one time, none", a.Name, a.Rounds, a.Took, a.Failures)
		}
	}
	want := []string{"./inbox", "./grpcbridge", "./transports/natsinbox", "./outbox", "./httpbridge", "./transports/kafkainbox"}
	if !slices.Equal(names, want) {
		t.Fatalf("areas %q, want %q", names, want)
	}
	inbox := area(t, g, "./inbox")
	if inbox.Package != "github.com/justonce/justonce/inbox" {
		t.Errorf("package %q", inbox.Package)
	}
	if inbox.Took[0] != 155495*time.Millisecond {
		t.Errorf("took %v, want 155.495s", inbox.Took[0])
	}
	b := bench(t, inbox, "BenchmarkLedgerVsBare/conns=8")
	if got := b.Samples["ratio"]; !slices.Equal(got, []float64{0.9483}) {
		t.Errorf("ratio %v, want [0.9483]", got)
	}
	if got := b.Samples["base-ops/s"]; !slices.Equal(got, []float64{974.4}) {
		t.Errorf("base-ops/s %v, want [974.4]", got)
	}
	wantUnits := []string{"ns/op", "base-ops/s", "floor-ops/s", "ops/s", "ratio", "ratio-vs-floor"}
	if !slices.Equal(b.Units, wantUnits) {
		t.Errorf("units %q, want %q", b.Units, wantUnits)
	}
	// The widest line: 17 metrics, among them units with µ, ± and %.
	w := bench(t, inbox, "BenchmarkRetentionWeek")
	if got := w.Samples["plain-size-swing-±%"]; !slices.Equal(got, []float64{48.50}) {
		t.Errorf("plain-size-swing-±%% %v", got)
	}
	if got := w.Samples["buckets-size-last/first-day"]; !slices.Equal(got, []float64{0.9958}) {
		t.Errorf("buckets-size-last/first-day %v", got)
	}
	// b.Log lines after the results (--- BENCH:) are no results.
	nats := area(t, g, "./transports/natsinbox")
	for _, b := range nats.Benchmarks {
		if strings.HasPrefix(b.Name, "---") || strings.Contains(b.Name, "bench_test.go") {
			t.Errorf("a log line read as a benchmark: %q", b.Name)
		}
	}
	golden(t, "small-one-round.md", markdown(t, g))
}

// Two rounds of four areas, as scripts/bench.sh logs BENCH_ROUNDS=2.
func TestParseRounds(t *testing.T) {
	g := parseFile(t, "small-two-rounds.txt")
	if len(g.Areas) != 4 {
		t.Fatalf("%d areas, want 4", len(g.Areas))
	}
	for _, a := range g.Areas {
		if a.Rounds != 2 || len(a.Took) != 2 {
			t.Errorf("%s: %d rounds, %d times; want 2 and 2", a.Name, a.Rounds, len(a.Took))
		}
		if !strings.HasPrefix(a.Command, "go test -run '^$' -bench '.' ") || !strings.HasSuffix(a.Command, " "+a.Name) {
			t.Errorf("%s: command %q", a.Name, a.Command)
		}
		for _, b := range a.Benchmarks {
			for _, u := range b.Units {
				if n := len(b.Samples[u]); n != 2 {
					t.Errorf("%s %s %s: %d samples, want one per round", a.Name, b.Name, u, n)
				}
			}
		}
	}
	if got := g.Commands(); len(got) != 4 {
		t.Errorf("commands %q, want one per area", got)
	}
	md := markdown(t, g)
	if !bytes.Contains(md, []byte("range over 2 rounds")) {
		t.Errorf("no range column:\n%s", md)
	}
	golden(t, "small-two-rounds.md", md)
}

// Output a benchmark printed itself, a failing benchmark, sub-benchmarks.
func TestParseQuirks(t *testing.T) {
	g := parseFile(t, "quirks.txt")
	if len(g.Areas) != 1 {
		t.Fatalf("%d areas, want 1 (the package, without markers)", len(g.Areas))
	}
	a := g.Areas[0]
	if a.Name != "bencap" || a.Rounds != 1 {
		t.Errorf("area %q with %d rounds", a.Name, a.Rounds)
	}
	if got := bench(t, a, "BenchmarkPrints").Samples["ratio"]; !slices.Equal(got, []float64{0.875}) {
		t.Errorf("ratio %v", got)
	}
	if got := bench(t, a, "BenchmarkSub/conns=8").Samples["heap-B/in-flight"]; !slices.Equal(got, []float64{3e9}) {
		t.Errorf("heap-B/in-flight %v", got)
	}
	if !g.Failed() || len(a.Failures) != 2 ||
		a.Failures[0] != "BenchmarkFails failed: q_test.go:23: claim: connection refused" ||
		a.Failures[1] != "bencap exited with FAIL" {
		t.Errorf("failures %q", a.Failures)
	}
	md := string(markdown(t, g))
	if !strings.Contains(md, "**Failed**: BenchmarkFails failed: q_test.go:23: claim: connection refused") {
		t.Errorf("the failure is not in the table:\n%s", md)
	}
	golden(t, "quirks.md", []byte(md))

	// go test -v: the skip's reason comes before --- SKIP; the parents of
	// sub-benchmarks print their name alone.
	v := parseFile(t, "quirks-v.txt").Areas[0]
	if got := bench(t, v, "BenchmarkSkipped").Skipped; got != "q_test.go:19: needs JUSTONCE_TEST_KAFKA_BROKERS" {
		t.Errorf("skip reason %q", got)
	}
	var names []string
	for _, b := range v.Benchmarks {
		names = append(names, b.Name)
	}
	if want := []string{"BenchmarkSkipped", "BenchmarkSub/conns=1", "BenchmarkSub/conns=8"}; !slices.Equal(names, want) {
		t.Errorf("benchmarks %q, want %q", names, want)
	}
}

// The benchmark's own output on the line of its results, and its results
// on a later line.
func TestResultsAfterOutput(t *testing.T) {
	log := "pkg: example.com/p\n" +
		"BenchmarkA-2   \tconnecting...\n" +
		"connected 8 conns       1\t  100 ns/op\t  0.5000 ratio\n" +
		"BenchmarkB-2   \tsome text 3\n" +
		"ok  \texample.com/p\t1.5s\n"
	g, err := ParseGoBench(strings.NewReader(log))
	if err != nil {
		t.Fatal(err)
	}
	a := g.Areas[0]
	if len(a.Benchmarks) != 1 || a.Benchmarks[0].Name != "BenchmarkA" || !slices.Equal(a.Benchmarks[0].Samples["ratio"], []float64{0.5}) {
		t.Errorf("benchmarks %+v", a.Benchmarks)
	}
	if !slices.Equal(a.Took, []time.Duration{1500 * time.Millisecond}) {
		t.Errorf("took %v", a.Took)
	}
}

// A round that failed leaves its benchmarks with fewer samples than
// rounds: the table says so.
func TestMissingRound(t *testing.T) {
	log := "== ./p (round 1 of 2): go test ./p\npkg: example.com/p\n" +
		"BenchmarkA-2 \t 1\t 1.000 ratio\t 10 ops/s\nok  \texample.com/p\t1s\n" +
		"== ./p (round 2 of 2): go test ./p\npkg: example.com/p\n" +
		"--- FAIL: BenchmarkA-2\n    a_test.go:9: boom\nFAIL\nFAIL\texample.com/p\t2s\n"
	g, err := ParseGoBench(strings.NewReader(log))
	if err != nil {
		t.Fatal(err)
	}
	a := g.Areas[0]
	if len(g.Areas) != 1 || a.Rounds != 2 {
		t.Fatalf("areas %d, rounds %d", len(g.Areas), a.Rounds)
	}
	want := []string{"BenchmarkA failed in round 2: a_test.go:9: boom", "example.com/p exited with FAIL in round 2"}
	if !slices.Equal(a.Failures, want) {
		t.Errorf("failures %q, want %q", a.Failures, want)
	}
	md := string(markdown(t, g))
	if !strings.Contains(md, "1.00×–1.00× (1 of 2 rounds)") {
		t.Errorf("no partial range:\n%s", md)
	}
}

func TestIsRatio(t *testing.T) {
	for unit, want := range map[string]bool{
		"ratio": true, "p99-ratio": true, "ratio-vs-floor": true, "buckets-throughput-ratio": true,
		"wrapped/bare": true, "p99_wrapped/bare": true, "franz/kafkainbox": true, "buckets-size-last/first-day": true,
		"buckets-p99-purging/quiet": true, "batch/per-event": true,
		"ops/s": false, "ns/op": false, "bare_ev/s": false, "heap-B/in-flight": false, "first-ns/call": false,
		"ns/msg": false, "p99-ms": false, "rows": false, "plain-size-swing-±%": false, "plain-deleted/call": false,
	} {
		if got := IsRatio(unit); got != want {
			t.Errorf("IsRatio(%q) = %v, want %v", unit, got, want)
		}
	}
}
