package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestTarget(t *testing.T) {
	root := "/repo"
	for _, c := range []struct {
		env         []string
		path, draft string // draft: a word the reason must hold, "" for none
	}{
		{nil, "/repo/docs/results/bench.md", ""},
		{[]string{"BENCH_ROUNDS=3", "PATH=/bin"}, "/repo/docs/results/bench.md", ""},
		{[]string{"JUSTONCE_BENCH_SCALE=1"}, "/repo/docs/results/bench-scale.md", ""},
		{[]string{"JUSTONCE_BENCH_SMALL=1"}, "/repo/bench-draft.md", "cannot rot"},
		{[]string{"JUSTONCE_BENCH_SMALL=1", "BENCH_RESULTS=/tmp/x.md"}, "/tmp/x.md", "cannot rot"},
		{[]string{"BENCH_AREAS=./inbox"}, "/repo/bench-draft.md", "BENCH_AREAS=./inbox"},
		{[]string{"BENCH=Claim"}, "/repo/bench-draft.md", "BENCH=Claim"},
		{[]string{"JUSTONCE_BENCH_SCALE=1", "JUSTONCE_BENCH_ROWS=5000000"}, "/repo/bench-draft.md", "JUSTONCE_BENCH_ROWS=5000000"},
		{[]string{"JUSTONCE_BENCH_KEYS=spread"}, "/repo/bench-draft.md", "JUSTONCE_BENCH_KEYS=spread"},
		{[]string{"JUSTONCE_BENCH_KEYS="}, "/repo/docs/results/bench.md", ""},
	} {
		path, title, draft := target(c.env, root)
		if path != c.path || title == "" || (c.draft == "") != (draft == "") || !strings.Contains(draft, c.draft) {
			t.Errorf("target(%q) = %q, %q, %q; want %q and a draft reason with %q", c.env, path, title, draft, c.path, c.draft)
		}
	}
}

// start, then write on a captured log: the file and stdout hold the header
// and the areas' tables.
func TestStartWrite(t *testing.T) {
	for _, kv := range os.Environ() { // a default run, whatever the caller's environment
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, "JUSTONCE_BENCH_") || name == "BENCH" || name == "BENCH_AREAS" {
			t.Setenv(name, "")
		}
	}
	dir := t.TempDir()
	out := filepath.Join(dir, "docs", "results", "bench.md")
	t.Setenv("BENCH_RESULTS", out)
	t.Setenv("BENCH_ROUNDS", "2")
	stateFile := filepath.Join(dir, "run.json")
	if err := start([]string{"-root", dir, "-state", stateFile, "-command", "make bench"}); err != nil {
		t.Fatal(err)
	}
	var stdout bytes.Buffer
	if err := write([]string{"-state", stateFile, "-log", "../../testdata/small-two-rounds.txt"}, &stdout); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, stdout.Bytes()) {
		t.Errorf("stdout is not the file")
	}
	s := string(b)
	for _, want := range []string{
		"## Benchmarks (make bench)\n", "- **command**: `make bench`\n", "`BENCH_ROUNDS=2`",
		"  - `go test -run '^$' -bench '.' -skip '^$' -benchtime 1x -timeout 60m ./grpcbridge`\n",
		"### ./transports/natsinbox\n", "range over 2 rounds", "| BenchmarkUnary ",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("results lack %q:\n%s", want, s)
		}
	}
	if strings.Contains(s, "Not meant to be read") {
		t.Errorf("a default run marked as a draft:\n%s", s)
	}
}
