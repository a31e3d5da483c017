package main

import (
	"context"
	"os"
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
	events, unique := workload(o.events, o.dupPercent, o.seed)
	for _, peer := range []string{peerJustonce, peerHandwritten} {
		r, err := crash(context.Background(), o, "test"+time.Now().Format("150405"), peer, events, unique)
		if err != nil {
			t.Fatalf("%s: %v", peer, err)
		}
		t.Logf("%s: SIGKILLed at %d of %d effects, %s; %d effects for %d IDs after the restart", peer, r.atKill, unique, r.riskText(), r.total, r.distinct)
		if r.atRisk <= 0 {
			t.Errorf("%s: the restart redelivered no event that had its effect: the crash tested nothing", peer)
		}
		if err := check([]result{{peer: peer, crash: r}}); err != nil {
			t.Error(err)
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
	events, unique := workload(o.events, o.dupPercent, o.seed)
	for _, peer := range []string{peerJustonce, peerHandwritten} {
		lost, doubled, failed, err := failure(context.Background(), o, "testf"+time.Now().Format("150405"), peer, events, unique)
		if err != nil {
			t.Fatalf("%s: %v", peer, err)
		}
		if failed == 0 {
			t.Fatalf("%s: no ID failed: the test tested nothing", peer)
		}
		if lost != 0 || doubled != 0 {
			t.Errorf("%s: %d IDs failed once: %d lost, %d doubled; want 0, 0", peer, failed, lost, doubled)
		}
	}
}
