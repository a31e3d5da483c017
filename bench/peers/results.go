package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
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
	r.Commands = []string{fmt.Sprintf("peers -events %d -dup %d -partitions %d -rounds %d -kill-at %g -seed %d -peers %s -timeout %v -faults=%v",
		o.events, o.dupPercent, o.partitions, o.rounds, o.killAt, o.seed, strings.Join(o.peers, ","), o.timeout, o.faults)}
	var reasons []string
	if o.events < defaultEvents {
		reasons = append(reasons, fmt.Sprintf("%d events, below the default %d: the size CI runs so that the comparison cannot rot. These numbers say nothing about the peers' speed.", o.events, defaultEvents))
	}
	if len(selected(o)) < len(peers) {
		reasons = append(reasons, "A subset of the peers ("+strings.Join(o.peers, ", ")+").")
	}
	if !o.faults {
		reasons = append(reasons, "The throughput rounds only: no crash, no failures.")
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

// writeResults writes the results file: the header, the tables the run
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
		for _, t := range resultsTables(o, res, unique, checkErr) {
			if err := t.Markdown(w); err != nil {
				return err
			}
		}
		return nil
	})
	if err == nil {
		fmt.Fprintln(os.Stderr, "peers: wrote", path)
	}
	return err
}

// resultsTables are the tables of a run: one per broker, with each peer's
// speed (and its ratio to justonce's front for that broker, round by
// round) and what the crash and the failures did; then what an event cost
// each peer; then the verdict.
func resultsTables(o options, res []result, unique int, checkErr error) []benchresults.Table {
	events, _ := workload(o.events, o.dupPercent, o.seed)
	failing := countFailing(events)
	several := o.rounds > 1
	var tables []benchresults.Table
	for _, table := range []string{tableKafka, tableNATS} {
		var rows []result
		for _, r := range res {
			if r.peer.table == table {
				rows = append(rows, r)
			}
		}
		if len(rows) == 0 {
			continue
		}
		t := benchresults.Table{Heading: "### " + table}
		if table == tableKafka {
			t.Before = []string{fmt.Sprintf("%d events per peer and phase (%d unique IDs, %d %% duplicates), one business row per event; throughput over %d round(s). Kafka: %d partitions.",
				o.events, unique, o.dupPercent, o.rounds, o.partitions)}
		} else {
			t.Before = []string{"The same stream in a JetStream stream (one subject, file storage), on one NATS server."}
		}
		vs := "vs " + rows[0].peer.name
		if several {
			t.Columns = []string{"peer", "events/s (median)", "events/s range", vs + " (median)", vs + " range"}
		} else {
			t.Columns = []string{"peer", "events/s", vs}
		}
		if o.faults {
			t.Columns = append(t.Columns, "SIGKILLed at", "done, read again", "lost", "doubled", "lost after 1 failure")
		}
		for _, r := range rows {
			rates := benchresults.Summarize(r.rates)
			// The ratio of each round: both peers ran in the same round.
			var ratios []float64
			for i, rate := range r.rates {
				if i < len(rows[0].rates) {
					ratios = append(ratios, rate/rows[0].rates[i])
				}
			}
			ratio := benchresults.Summarize(ratios)
			row := []string{r.peer.name, fmt.Sprintf("%.0f", rates.Median)}
			if several {
				row = append(row, rates.Range(func(v float64) string { return fmt.Sprintf("%.0f", v) }))
			}
			row = append(row, benchresults.FormatRatio(ratio.Median))
			if several {
				row = append(row, ratio.Range(benchresults.FormatRatio))
			}
			if o.faults {
				row = append(row, fmt.Sprintf("%d/%d effects", r.crash.atKill, unique), fmt.Sprint(r.crash.atRisk),
					fmt.Sprint(r.crash.lost), fmt.Sprint(r.crash.doubled), fmt.Sprintf("%d/%d", r.failLost, failing))
			}
			t.Rows = append(t.Rows, row)
		}
		t.Right = rightAligned(len(t.Columns))
		past := "past the committed offsets"
		if table == tableNATS {
			past = "past the durable's ack floor"
		}
		ratio := vs + ": the peer's events/s divided by " + rows[0].peer.name + "'s"
		if several {
			ratio += ", in each round (the peers take turns within a round, the order alternating)"
		}
		t.After = append(t.After, "events/s: from the first effect to the last (database timestamps, so group joins do not count). "+ratio+".")
		if !o.faults {
			tables = append(tables, t)
			continue
		}
		t.After = append(t.After,
			"SIGKILLed at: effects when the consumer was killed, once, mid-stream. done, read again: deliveries to the restarted consumer ("+past+") of IDs that already had their effect. lost: IDs left without an effect; doubled: effects beyond one per ID.",
			fmt.Sprintf("lost after 1 failure: a run without a crash in which the first attempt of one ID in 250 (%d IDs) fails, then succeeds.", failing))
		var why []string
		for _, r := range rows {
			if r.peer.mayDouble != "" {
				why = append(why, "- "+r.peer.name+" may double: "+r.peer.mayDouble)
			}
			if r.peer.mayLose != "" {
				why = append(why, "- "+r.peer.name+" may lose: "+r.peer.mayLose)
			}
		}
		if len(why) > 0 {
			t.After = append(t.After, strings.Join(why, "\n"))
		}
		tables = append(tables, t)
	}
	tables = append(tables, costTable(o, res))
	verdict := benchresults.Table{}
	switch {
	case !o.faults:
		verdict.After = []string{"No crash or failure phase ran (-faults=false)."}
	case checkErr != nil:
		verdict.After = []string{"**Check failed**: " + strings.ReplaceAll(checkErr.Error(), "\n", "; ") + "."}
	default:
		var names []string
		for _, r := range res {
			if r.peer.mayDouble == "" && r.peer.mayLose == "" {
				names = append(names, r.peer.name)
			}
		}
		verdict.After = []string{"Check passed: no peer lost an effect to the crash or doubled one after a failure, and " + strings.Join(names, "; ") + " neither lost nor doubled one anywhere."}
	}
	return append(tables, verdict)
}

// costTable says what an event cost each peer in the throughput rounds
// (the median of the rounds).
func costTable(o options, res []result) benchresults.Table {
	t := benchresults.Table{
		Heading: "### What an event costs",
		Before: []string{fmt.Sprintf("Per event of the throughput rounds (%d events, duplicates included; the median of the rounds): what the consumer sent to Postgres, "+
			"the CPU time of the consumer process and of its Postgres backends up to the last effect.", o.events)},
		Columns: []string{"peer", "round trips", "statements", "client CPU µs", "Postgres CPU µs"},
	}
	for _, r := range res {
		var rt, st, cl, sv []float64
		server := true
		for _, c := range r.costs {
			pe := c.per(o.events)
			rt, st, cl, sv = append(rt, pe.roundTrips), append(st, pe.statements), append(cl, pe.clientUS), append(sv, pe.serverUS)
			server = server && pe.server
		}
		if len(rt) == 0 {
			continue
		}
		srv := "–"
		if server {
			srv = fmt.Sprintf("%.0f", median(sv))
		}
		t.Rows = append(t.Rows, []string{r.peer.name, fmt.Sprintf("%.2f", median(rt)), fmt.Sprintf("%.2f", median(st)),
			fmt.Sprintf("%.0f", median(cl)), srv})
	}
	t.Right = rightAligned(len(t.Columns))
	t.After = []string{"round trips: a read after writes on one of the consumer's Postgres connections; statements: the Execute and Query messages it sent " +
		"(counted by the consumer process on its pool's connections). Postgres CPU: the consumer's backends, from /proc (\"–\" when Postgres runs elsewhere). " +
		"The CPU times include the consumer's start and its waits for the broker; a busy machine inflates them all."}
	return t
}

// rightAligned right-aligns every column but the first.
func rightAligned(n int) []bool {
	r := make([]bool, n)
	for i := 1; i < n; i++ {
		r[i] = true
	}
	return r
}
