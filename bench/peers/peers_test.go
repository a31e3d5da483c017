package main

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"
)

// TestMain lets the test binary be a peer's consumer process too, as the
// crash test starts and SIGKILLs it.
func TestMain(m *testing.M) {
	if isChild() {
		if err := runChild(); err != nil {
			os.Stderr.WriteString("peers child: " + err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// The workload is the same for every peer and every run of a seed: n
// events, exactly the asked share duplicates, each duplicate after its
// original, and the last tenth of the stream first occurrences only (so an
// ordered consumer that has an effect for every ID has read everything).
func TestWorkload(t *testing.T) {
	events, unique := workload(2000, 20, 7)
	again, _ := workload(2000, 20, 7)
	if len(events) != 2000 || unique != 1600 {
		t.Fatalf("got %d events, %d unique; want 2000, 1600", len(events), unique)
	}
	seen := map[string]bool{}
	for i, e := range events {
		if e != again[i] {
			t.Fatalf("event %d differs between two runs of one seed: %v, %v", i, e, again[i])
		}
		if seen[e.ID] && i >= 1800 {
			t.Fatalf("event %d (%s) is a duplicate in the last tenth", i, e.ID)
		}
		seen[e.ID] = true
	}
	if len(seen) != unique {
		t.Fatalf("%d distinct IDs, workload said %d", len(seen), unique)
	}
}

// The peers that claim exactly-once effects keep it through a SIGKILL of
// the consumer mid-stream (crash fails unless some but not all effects
// were there when it was killed), and the restart redelivered events whose
// effect was already there: against the real Kafka and Postgres.
func TestCrashExactlyOnce(t *testing.T) {
	pgURL, brokers, err := services()
	if err != nil {
		t.Fatal(err)
	}
	o := options{events: 600, dupPercent: 20, partitions: 2, killAt: 0.3, seed: 3, timeout: 2 * time.Minute, pgURL: pgURL, brokers: brokers}
	o.natsURL = testNATS(t)
	events, unique := workload(o.events, o.dupPercent, o.seed)
	for _, name := range claimants {
		p, _ := peerNamed(name)
		r, err := crash(context.Background(), o, "test"+time.Now().Format("150405"), p, events, unique)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%s: SIGKILLed at %d of %d effects, %s; %d effects for %d IDs after the restart", name, r.atKill, unique, r.riskText(), r.total, r.distinct)
		if r.atRisk <= 0 {
			t.Errorf("%s: the restart redelivered no event that had its effect: the crash tested nothing", name)
		}
		if err := check([]result{{peer: p, crash: r}}); err != nil {
			t.Error(err)
		}
	}
}

// claimants are the peers that claim exactly-once effects: justonce's
// fronts and the hand-written inboxes.
var claimants = []string{peerJustonce, peerJustonceFranz, peerHandwritten, peerJustonceNATS, peerHandwrittenNATS}

// testNATS starts the embedded NATS server for the test.
func testNATS(t *testing.T) string {
	t.Helper()
	url, stop, err := startNATS()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	return url
}

// Every peer has a name and a slug of its own, its table's first peer is
// justonce's front for that broker, and a run of a table without it is
// refused.
func TestPeers(t *testing.T) {
	names, slugs := map[string]bool{}, map[string]bool{}
	for _, p := range peers {
		if names[p.name] || slugs[p.slug] || p.consume == nil {
			t.Errorf("peer %q (%s): name or slug taken, or no consumer", p.name, p.slug)
		}
		names[p.name], slugs[p.slug] = true, true
	}
	for _, table := range []string{tableKafka, tableNATS} {
		if b := tableBase(table); !strings.HasPrefix(b.name, "justonce") {
			t.Errorf("table %s is compared with %s", table, b.name)
		}
	}
	for peers, ok := range map[string]bool{
		"justonce,watermill":               true,
		"watermill":                        false,
		"justonce,watermill-nats":          false,
		"justonce-nats,watermill-nats":     true,
		"justonce,justonce-nats,nosuchone": false,
	} {
		if err := checkSelection(options{peers: strings.Split(peers, ",")}); (err == nil) != ok {
			t.Errorf("-peers %s: %v", peers, err)
		}
	}
}

// A handler that fails once (one ID in 250, its first attempt) has its
// effect once when it is retried, in the peers that claim exactly once.
func TestFailureExactlyOnce(t *testing.T) {
	pgURL, brokers, err := services()
	if err != nil {
		t.Fatal(err)
	}
	o := options{events: 600, dupPercent: 20, partitions: 2, seed: 3, timeout: 2 * time.Minute, pgURL: pgURL, brokers: brokers}
	o.natsURL = testNATS(t)
	events, unique := workload(o.events, o.dupPercent, o.seed)
	for _, name := range claimants {
		p, _ := peerNamed(name)
		lost, doubled, failed, err := failure(context.Background(), o, "testf"+time.Now().Format("150405"), p, events, unique)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if failed == 0 {
			t.Fatalf("%s: no ID failed: the test tested nothing", name)
		}
		if lost != 0 || doubled != 0 {
			t.Errorf("%s: %d IDs failed once: %d lost, %d doubled; want 0, 0", name, failed, lost, doubled)
		}
	}
}
