package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func threeRounds() ([]result, options) {
	o := options{events: 2000, dupPercent: 20, partitions: 4, rounds: 3, killAt: 0.3, seed: 1, timeout: time.Minute,
		peers: []string{"justonce", "handwritten", "watermill"}}
	res := []result{
		{peer: peerJustonce, rates: []float64{1000, 1200, 800}},
		{peer: peerHandwritten, rates: []float64{500, 900, 400}, crash: crashResult{atKill: 480, atRisk: 12}},
		{peer: peerWatermill, rates: []float64{2000, 2400, 1200}, crash: crashResult{atKill: 500, doubled: 7}, failLost: 6},
	}
	return res, o
}

// The ratio of each peer is taken in each round, then summarized.
func TestResultsTable(t *testing.T) {
	res, o := threeRounds()
	var b bytes.Buffer
	if err := resultsTable(o, res, 1600, nil).Markdown(&b); err != nil {
		t.Fatal(err)
	}
	md := b.String()
	for _, want := range []string{
		"| events/s (median) | events/s range | vs justonce (median) | vs justonce range |",
		// 500/1000, 900/1200, 400/800: 0.50, 0.75, 0.50
		"| hand-written inbox      |               500 |        400–900 |                0.50× |       0.50×–0.75× | 480/1600 effects |",
		// 2.00, 2.00, 1.50
		"|                2.00× |       1.50×–2.00× |",
		"- watermill kafka + dedup may double: ",
		"Check passed: ",
		"justonce; hand-written inbox neither lost nor doubled one anywhere.",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("table lacks %q:\n%s", want, md)
		}
	}
	b.Reset()
	o.rounds = 1
	for i := range res {
		res[i].rates = res[i].rates[:1]
	}
	_ = resultsTable(o, res, 1600, errors.New("justonce lost 1 effects")).Markdown(&b)
	if md := b.String(); strings.Contains(md, "range") || !strings.Contains(md, "**Check failed**: justonce lost 1 effects.") {
		t.Errorf("one round, failed check:\n%s", md)
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
		path   string
		draft  bool
	}{
		{defaultEvents, all, filepath.Join(root, "docs/results/peers.md"), false},
		{50000, all, filepath.Join(root, "docs/results/peers.md"), false},
		{2000, all, filepath.Join(root, "peers-draft.md"), true},
		{defaultEvents, all[:2], filepath.Join(root, "peers-draft.md"), true},
	} {
		r, path := beginResults(options{events: c.events, peers: c.peers, rounds: 1})
		if path != c.path || (r.Draft != "") != c.draft || r.Commit == "" || r.LoadStart == "" {
			t.Errorf("events %d, peers %v: %q, draft %q; want %q, draft %v", c.events, c.peers, path, r.Draft, c.path, c.draft)
		}
	}
	dir := t.TempDir()
	*resultsPath = filepath.Join(dir, "sub", "p.md")
	r, path := beginResults(options{events: 2000, peers: all, rounds: 3})
	res, o := threeRounds()
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
