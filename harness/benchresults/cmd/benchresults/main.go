// Command benchresults writes the results file of a scripts/bench.sh run
// from its log (bench.out, go test -bench output with one marker line per
// area and round), and prints it.
//
//	benchresults start -root . -state run.json -command 'make bench'
//	... the benchmarks, logged to bench.out ...
//	benchresults write -state run.json -log bench.out
//	benchresults include docs/performance.md
//
// start records the run's beginning (date, commit, machine, load average)
// and, from the environment as the caller set it, where the results go:
//
//   - docs/results/bench.md for a default run, docs/results/bench-scale.md
//     for JUSTONCE_BENCH_SCALE=1: files meant for the documentation;
//   - bench-draft.md at the repository root (ignored by git), marked as
//     not meant to be read, for any other run: the small sizes CI runs
//     (JUSTONCE_BENCH_SMALL=1), a subset (BENCH, BENCH_AREAS) or other
//     sizes and workloads (any other JUSTONCE_BENCH_* variable);
//   - BENCH_RESULTS, when set, names the file instead.
//
// write reads the log, writes the file (the header, then one table per
// area) and prints it on stdout.
//
// include brings the include blocks of the documents named up to date
// with the results files they include (see benchresults.Include): the
// performance page shows the latest run's tables as they were written.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/justonce/justonce/harness/benchresults"
)

// knobs are the environment variables a results file lists: those that
// set the run.
var knobs = []string{"JUSTONCE_BENCH_*", "BENCH", "BENCH_AREAS", "BENCH_ROUNDS", "BENCH_RESULTS",
	"GOMAXPROCS", "GOGC", "GOMEMLIMIT", "GODEBUG", "GOEXPERIMENT", "GOAMD64", "GOFLAGS"}

// state is what start hands to write.
type state struct {
	Run    benchresults.Run `json:"run"`
	Output string           `json:"output"`
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "start":
		err = start(os.Args[2:])
	case "write":
		err = write(os.Args[2:], os.Stdout)
	case "include":
		err = include(os.Args[2:])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchresults:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: benchresults start -root DIR -state FILE -command CMD | write -state FILE -log FILE | include DOC...")
	os.Exit(2)
}

func start(args []string) error {
	fs := flag.NewFlagSet("start", flag.ExitOnError)
	root := fs.String("root", ".", "repository root")
	stateFile := fs.String("state", "", "file to hand to write")
	command := fs.String("command", "bash scripts/bench.sh", "the command as the user ran it")
	_ = fs.Parse(args)
	if *stateFile == "" {
		return errors.New("start: -state is required")
	}
	abs, err := filepath.Abs(*root)
	if err != nil {
		return err
	}
	s := state{Run: benchresults.Begin(abs)}
	s.Run.Command = *command
	s.Output, s.Run.Title, s.Run.Draft = target(os.Environ(), abs)
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	return os.WriteFile(*stateFile, b, 0o644)
}

// target says where a run's results go, under which title, and why they
// are not meant to be read ("" for a run meant for the documentation),
// from the environment the caller set (NAME=value, as os.Environ).
func target(env []string, root string) (path, title, draft string) {
	vars := map[string]string{}
	var custom []string
	for _, kv := range env {
		name, v, _ := strings.Cut(kv, "=")
		vars[name] = v
		if strings.HasPrefix(name, "JUSTONCE_BENCH_") && name != "JUSTONCE_BENCH_SMALL" && name != "JUSTONCE_BENCH_SCALE" && v != "" {
			custom = append(custom, kv)
		}
	}
	getenv := func(name string) string { return vars[name] }
	slices.Sort(custom)
	var subset []string
	for _, name := range []string{"BENCH", "BENCH_AREAS"} {
		if v := getenv(name); v != "" {
			subset = append(subset, name+"="+v)
		}
	}
	draftPath := filepath.Join(root, "bench-draft.md")
	switch {
	case getenv("JUSTONCE_BENCH_SMALL") == "1":
		path, title = draftPath, "Benchmarks at the small sizes"
		draft = "JUSTONCE_BENCH_SMALL=1: a few short rounds of every benchmark, run (by CI too) so that the benchmarks cannot rot. These numbers say nothing about justonce's speed."
	case len(subset) > 0:
		path, title = draftPath, "Benchmarks: a subset"
		draft = "A subset of the benchmarks (" + strings.Join(subset, ", ") + "), not the set the documentation quotes."
	case len(custom) > 0:
		path, title = draftPath, "Benchmarks at other sizes"
		draft = "Sizes or workloads other than the defaults (" + strings.Join(custom, ", ") + "), not those the documentation quotes."
	case getenv("JUSTONCE_BENCH_SCALE") == "1":
		path, title = filepath.Join(root, benchresults.ResultsDir, "bench-scale.md"), "Benchmarks at scale (JUSTONCE_BENCH_SCALE=1)"
	default:
		path, title = filepath.Join(root, benchresults.ResultsDir, "bench.md"), "Benchmarks (make bench)"
	}
	if p := getenv("BENCH_RESULTS"); p != "" {
		path = p
	}
	return path, title, draft
}

func write(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("write", flag.ExitOnError)
	stateFile := fs.String("state", "", "the file start wrote")
	logFile := fs.String("log", "bench.out", "the go test -bench log")
	_ = fs.Parse(args)
	b, err := os.ReadFile(*stateFile)
	if err != nil {
		return err
	}
	var s state
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("%s: %w", *stateFile, err)
	}
	f, err := os.Open(*logFile)
	if err != nil {
		return err
	}
	g, err := benchresults.ParseGoBench(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("%s: %w", *logFile, err)
	}
	run := s.Run
	run.End()
	run.Knobs = benchresults.Knobs(os.Environ(), knobs...)
	run.Commands = g.Commands()
	if g.Failed() {
		run.Notes = append(run.Notes, "**some benchmarks failed**: see the areas below, and bench.out")
	}
	run.Notes = append(run.Notes, "ratios (×) compare what a benchmark measures with its baseline, run in the same process and interleaved with it; the other metrics are the raw ones each benchmark reports (its doc comment says what they are)")
	body := func(w io.Writer) error {
		for _, t := range g.Tables() {
			if err := t.Markdown(w); err != nil {
				return err
			}
		}
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(s.Output), 0o755); err != nil {
		return err
	}
	if err := benchresults.WriteFile(s.Output, run, body); err != nil {
		return err
	}
	out, err := os.ReadFile(s.Output)
	if err != nil {
		return err
	}
	if _, err := stdout.Write(out); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "benchresults: wrote %s\n", s.Output)
	return nil
}

func include(docs []string) error {
	if len(docs) == 0 {
		return errors.New("include: name the documents")
	}
	for _, d := range docs {
		changed, err := benchresults.IncludeFile(d)
		if err != nil {
			return err
		}
		if changed {
			fmt.Fprintf(os.Stderr, "benchresults: %s now includes the latest results\n", d)
		}
	}
	return nil
}
