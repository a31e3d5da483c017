package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/justonce/justonce/harness/benchresults"
)

// defaultEvents is the default of -events: runs below it are too small to
// be read (CI runs 2000 so that the comparison cannot rot).
const defaultEvents = 20000

// resultsPath is where the results go; "" picks docs/results/peers.md for
// a run at the default size or more with every peer, else peers-draft.md
// at the repository root (ignored by git), marked as not meant to be read.
var resultsPath = flag.String("results", os.Getenv("PEERS_RESULTS"), "results file (default: docs/results/peers.md, or peers-draft.md for a small or partial run)")

// beginResults records the start of the run for the results' header.
func beginResults(o options) (benchresults.Run, string) {
	root, rootErr := benchresults.RepoRoot(".")
	r := benchresults.Begin(root)
	r.Title = "justonce beside its peers (make bench-peers)"
	r.Command = os.Getenv("BENCH_COMMAND")
	if r.Command == "" {
		r.Command = strings.TrimSpace("cd bench/peers && go run . " + strings.Join(os.Args[1:], " "))
	}
	r.Commands = []string{fmt.Sprintf("peers -events %d -dup %d -partitions %d -rounds %d -kill-at %g -seed %d -peers %s -timeout %v",
		o.events, o.dupPercent, o.partitions, o.rounds, o.killAt, o.seed, strings.Join(o.peers, ","), o.timeout)}
	var reasons []string
	if o.events < defaultEvents {
		reasons = append(reasons, fmt.Sprintf("%d events, below the default %d: the size CI runs so that the comparison cannot rot. These numbers say nothing about the peers' speed.", o.events, defaultEvents))
	}
	if len(o.peers) < len(peerNames) {
		reasons = append(reasons, "A subset of the peers ("+strings.Join(o.peers, ", ")+").")
	}
	r.Draft = strings.Join(reasons, " ")
	path := *resultsPath
	switch {
	case path != "":
	case rootErr != nil:
		fmt.Fprintln(os.Stderr, "peers: results not written:", rootErr, "(set -results)")
	case r.Draft != "":
		path = filepath.Join(root, "peers-draft.md")
	default:
		path = filepath.Join(root, benchresults.ResultsDir, "peers.md")
	}
	return r, path
}

// writeResults writes the results file: the header, the table the run
// printed (with each ratio's median and range over the rounds), what the
// columns mean, and the check's verdict.
func writeResults(r benchresults.Run, path string, o options, res []result, unique int, checkErr error) error {
	if path == "" {
		return nil
	}
	r.End()
	r.Knobs = benchresults.Knobs(os.Environ(), "PEERS_*", "GOMAXPROCS", "GOGC", "GOMEMLIMIT", "GODEBUG", "GOEXPERIMENT", "GOAMD64", "GOFLAGS")
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	err := benchresults.WriteFile(path, r, func(w io.Writer) error {
		return resultsTable(o, res, unique, checkErr).Markdown(w)
	})
	if err == nil {
		fmt.Fprintln(os.Stderr, "peers: wrote", path)
	}
	return err
}

func resultsTable(o options, res []result, unique int, checkErr error) benchresults.Table {
	events, _ := workload(o.events, o.dupPercent, o.seed)
	failing := countFailing(events)
	t := benchresults.Table{
		Before: []string{fmt.Sprintf("%d events per peer and phase (%d unique IDs, %d %% duplicates), %d Kafka partitions, one business row per event; throughput over %d round(s).",
			o.events, unique, o.dupPercent, o.partitions, o.rounds)},
	}
	several := o.rounds > 1
	if several {
		t.Columns = []string{"peer", "events/s (median)", "events/s range", "vs justonce (median)", "vs justonce range"}
	} else {
		t.Columns = []string{"peer", "events/s", "vs justonce"}
	}
	t.Columns = append(t.Columns, "SIGKILLed at", "done, read again", "lost", "doubled", "lost after 1 failure")
	for _, r := range res {
		rates := benchresults.Summarize(r.rates)
		// The ratio of each round: both peers ran in the same round.
		var ratios []float64
		for i, rate := range r.rates {
			if i < len(res[0].rates) {
				ratios = append(ratios, rate/res[0].rates[i])
			}
		}
		ratio := benchresults.Summarize(ratios)
		row := []string{r.peer, fmt.Sprintf("%.0f", rates.Median)}
		if several {
			row = append(row, rates.Range(func(v float64) string { return fmt.Sprintf("%.0f", v) }))
		}
		row = append(row, benchresults.FormatRatio(ratio.Median))
		if several {
			row = append(row, ratio.Range(benchresults.FormatRatio))
		}
		row = append(row, fmt.Sprintf("%d/%d effects", r.crash.atKill, unique), fmt.Sprint(r.crash.atRisk),
			fmt.Sprint(r.crash.lost), fmt.Sprint(r.crash.doubled), fmt.Sprintf("%d/%d", r.failLost, failing))
		t.Rows = append(t.Rows, row)
	}
	t.Right = make([]bool, len(t.Columns))
	for i := 1; i < len(t.Right); i++ {
		t.Right[i] = true
	}
	vs := "vs justonce: the peer's events/s over justonce's"
	if several {
		vs += ", in each round (the peers take turns within a round, the order alternating)"
	}
	t.After = append(t.After,
		"events/s: from the first effect to the last (database timestamps, so group joins do not count). "+vs+".",
		"SIGKILLed at: effects when the consumer was killed, once, mid-stream. done, read again: deliveries to the restarted consumer (past the committed offsets) of IDs that already had their effect. lost: IDs left without an effect; doubled: effects beyond one per ID.",
		fmt.Sprintf("lost after 1 failure: a run without a crash in which the first attempt of one ID in 250 (%d IDs) fails, then succeeds.", failing))
	var why []string
	for _, r := range res {
		if w, ok := mayDouble[r.peer]; ok {
			why = append(why, "- "+r.peer+" may double: "+w)
		}
		if w, ok := mayLose[r.peer]; ok {
			why = append(why, "- "+r.peer+" may lose: "+w)
		}
	}
	if len(why) > 0 {
		t.After = append(t.After, strings.Join(why, "\n"))
	}
	if checkErr != nil {
		t.After = append(t.After, "**Check failed**: "+strings.ReplaceAll(checkErr.Error(), "\n", "; ")+".")
	} else {
		claims := slices.DeleteFunc(slices.Clone(res), func(r result) bool {
			_, d := mayDouble[r.peer]
			_, l := mayLose[r.peer]
			return d || l
		})
		var names []string
		for _, r := range claims {
			names = append(names, r.peer)
		}
		t.After = append(t.After, "Check passed: no peer lost an effect to the crash or doubled one after a failure, and "+strings.Join(names, "; ")+" neither lost nor doubled one anywhere.")
	}
	return t
}
