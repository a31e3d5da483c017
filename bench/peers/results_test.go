package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/justonce/justonce/harness/benchresults"
)

func named(t *testing.T, name string) peer {
	t.Helper()
	p, ok := peerNamed(name)
	if !ok {
		t.Fatalf("no peer %q", name)
	}
	return p
}

func threeRounds(t *testing.T) ([]result, options) {
	o := options{events: 2000, dupPercent: 20, partitions: 4, rounds: 3, killAt: 0.3, seed: 1, timeout: time.Minute, faults: true,
		peers: []string{"justonce", "handwritten", "watermill", "justonce-nats", "watermill-nats"}}
	c := cost{child: childStats{RoundTrips: 2000, Statements: 3000}, clientCPU: 200 * time.Millisecond, serverCPU: 100 * time.Millisecond, serverSeen: true}
	res := []result{
		{peer: named(t, peerJustonce), rates: []float64{1000, 1200, 800}, costs: []cost{c, c, c}},
		{peer: named(t, peerHandwritten), rates: []float64{500, 900, 400}, crash: crashResult{atKill: 480, atRisk: 12}},
		{peer: named(t, peerWatermill), rates: []float64{2000, 2400, 1200}, crash: crashResult{atKill: 500, doubled: 7}, failLost: 6},
		{peer: named(t, peerJustonceNATS), rates: []float64{100, 300, 200}},
		{peer: named(t, peerWatermillNATS), rates: []float64{50, 600, 100}},
	}
	return res, o
}

func markdown(t *testing.T, tables []benchresults.Table) string {
	t.Helper()
	var b bytes.Buffer
	for _, tb := range tables {
		if err := tb.Markdown(&b); err != nil {
			t.Fatal(err)
		}
	}
	return b.String()
}

// The ratio of each peer is taken in each round, against justonce's front
// for its broker, then summarized; each broker has its table, and the
// costs theirs.
func TestResultsTable(t *testing.T) {
	res, o := threeRounds(t)
	md := markdown(t, resultsTables(o, res, 1600, nil))
	for _, want := range []string{
		"### Kafka\n",
		"| events/s (median) | events/s range | vs justonce (median) | vs justonce range |",
		// 500/1000, 900/1200, 400/800: 0.50, 0.75, 0.50
		"| hand-written inbox      |               500 |        400–900 |                0.50× |       0.50×–0.75× | 480/1600 effects |",
		// 2.00, 2.00, 1.50
		"|                2.00× |       1.50×–2.00× |",
		"- watermill kafka + dedup may double: ",
		"### NATS JetStream\n",
		"| vs justonce, JetStream (median) |",
		// 50/100, 600/300, 100/200: 0.50, 2.00, 0.50
		"|                           0.50× |                  0.50×–2.00× |",
		"- watermill jetstream + dedup may lose: ",
		"### What an event costs\n",
		// 2000 round trips, 3000 statements, 200 ms and 100 ms over 2000 events
		"| justonce |        1.00 |       1.50 |           100 |              50 |",
		"Check passed: ",
		"justonce; hand-written inbox; justonce, JetStream neither lost nor doubled one anywhere.",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("tables lack %q:\n%s", want, md)
		}
	}
	o.rounds = 1
	for i := range res {
		res[i].rates = res[i].rates[:1]
	}
	md = markdown(t, resultsTables(o, res, 1600, errors.New("justonce lost 1 effects")))
	if strings.Contains(md, "range") || !strings.Contains(md, "**Check failed**: justonce lost 1 effects.") {
		t.Errorf("one round, failed check:\n%s", md)
	}
	o.faults = false
	md = markdown(t, resultsTables(o, res, 1600, nil))
	if strings.Contains(md, "SIGKILLed") || strings.Contains(md, "Check passed") || !strings.Contains(md, "No crash or failure phase ran") {
		t.Errorf("throughput only:\n%s", md)
	}
}

// A run below the default size, or with a subset of the peers, is a draft
// and goes to peers-draft.md; a full one to docs/results/peers.md.
func TestResultsTarget(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	defer func(p string) { *resultsPath = p }(*resultsPath)
	*resultsPath = "" // whatever PEERS_RESULTS says
	all := slugs()
	for _, c := range []struct {
		events int
		peers  []string
		faults bool
		path   string
		draft  bool
	}{
		{defaultEvents, all, true, filepath.Join(root, "docs/results/peers.md"), false},
		{50000, all, true, filepath.Join(root, "docs/results/peers.md"), false},
		{2000, all, true, filepath.Join(root, "peers-draft.md"), true},
		{defaultEvents, all[:2], true, filepath.Join(root, "peers-draft.md"), true},
		{defaultEvents, all, false, filepath.Join(root, "peers-draft.md"), true},
	} {
		r, path := beginResults(options{events: c.events, peers: c.peers, rounds: 1, faults: c.faults})
		if path != c.path || (r.Draft != "") != c.draft || r.Commit == "" || r.LoadStart == "" {
			t.Errorf("events %d, peers %v, faults %v: %q, draft %q; want %q, draft %v", c.events, c.peers, c.faults, path, r.Draft, c.path, c.draft)
		}
	}
	dir := t.TempDir()
	*resultsPath = filepath.Join(dir, "sub", "p.md")
	r, path := beginResults(options{events: 2000, peers: all, rounds: 3, faults: true})
	res, o := threeRounds(t)
	if err := writeResults(r, path, o, res, 1600, nil); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(*resultsPath)
	if err != nil {
		t.Fatal(err)
	}
	if s := string(got); !strings.HasPrefix(s, "## justonce beside its peers") || !strings.Contains(s, "> **Not meant to be read.** 2000 events") ||
		!strings.Contains(s, "- **ran**: `peers -events 2000 ") {
		t.Errorf("results file:\n%s", s)
	}
}
