package benchresults

import (
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestMachineFromProc(t *testing.T) {
	if got := memTotal("MemTotal:       24567890 kB\nMemFree: 1 kB\n"); got != 24567890*1024 {
		t.Errorf("memTotal = %d", got)
	}
	if got := memTotal("MemFree: 1 kB\n"); got != 0 {
		t.Errorf("memTotal without MemTotal = %d", got)
	}
	x86 := "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC   7B13 64-Core Processor\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n"
	if got := cpuModel(x86); got != "AMD EPYC 7B13 64-Core Processor" {
		t.Errorf("cpuModel(x86) = %q", got)
	}
	arm := "processor\t: 0\nBogoMIPS\t: 108.00\nCPU part\t: 0xd0c\n\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4\n"
	if got := cpuModel(arm); got != "Raspberry Pi 4 Model B Rev 1.4" {
		t.Errorf("cpuModel(arm) = %q", got)
	}
	if got := cpuModel("processor\t: 0\n"); got != "" {
		t.Errorf("cpuModel(nothing) = %q", got)
	}
}

func TestKnobs(t *testing.T) {
	env := []string{"PATH=/bin", "JUSTONCE_BENCH_ROWS=20000", "BENCH_ROUNDS=3", "BENCHX=1", "JUSTONCE_BENCH_SMALL=1", "GOMAXPROCS=2", "HOME=/root"}
	got := Knobs(env, "JUSTONCE_BENCH_*", "BENCH_ROUNDS", "GOMAXPROCS", "BENCH")
	want := []string{"BENCH_ROUNDS=3", "GOMAXPROCS=2", "JUSTONCE_BENCH_ROWS=20000", "JUSTONCE_BENCH_SMALL=1"}
	if !slices.Equal(got, want) {
		t.Errorf("Knobs = %q, want %q", got, want)
	}
}

func TestBegin(t *testing.T) {
	r := Begin(".")
	if r.Cores < 1 || r.Go == "" || r.Started.IsZero() || r.Kernel == "" || r.CPU == "" {
		t.Errorf("Begin = %+v", r)
	}
	if _, err := os.Stat("/proc/loadavg"); err == nil {
		if len(strings.Fields(r.LoadStart)) != 3 || r.MemoryBytes == 0 {
			t.Errorf("load %q, memory %d", r.LoadStart, r.MemoryBytes)
		}
	}
	r.End()
	if r.Ended.Before(r.Started) || r.LoadEnd == "" {
		t.Errorf("End: %v .. %v, load %q", r.Started, r.Ended, r.LoadEnd)
	}
}

// The commit and the dirty paths, changes under ResultsDir aside.
func TestGitState(t *testing.T) {
	if _, err := exec.LookPath("git"); err != nil {
		t.Skip("no git")
	}
	dir := t.TempDir()
	git := func(args ...string) string {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-C", dir, "-c", "user.name=t", "-c", "user.email=t@example.com"}, args...)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	write := func(rel, s string) {
		t.Helper()
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	git("init", "-q")
	write("a.go", "package a\n")
	write(ResultsDir+"/bench.md", "old\n")
	git("add", ".")
	git("commit", "-q", "-m", "first")
	head := git("rev-parse", "HEAD")

	if commit, dirty := gitState(dir); commit != head || len(dirty) != 0 {
		t.Errorf("clean tree: %q %q, want %q and nothing", commit, dirty, head)
	}
	write(ResultsDir+"/bench.md", "new\n")
	if _, dirty := gitState(dir); len(dirty) != 0 {
		t.Errorf("a changed results file made the tree dirty: %q", dirty)
	}
	write("a.go", "package a // changed\n")
	write("b.go", "package a\n")
	if _, dirty := gitState(dir); !slices.Equal(dirty, []string{"a.go", "b.go"}) {
		t.Errorf("dirty %q, want a.go and b.go", dirty)
	}
	if commit, _ := gitState(t.TempDir()); !strings.HasPrefix(commit, "unknown (") {
		t.Errorf("outside a repository: commit %q", commit)
	}
}

func TestWriteHeader(t *testing.T) {
	start := time.Date(2026, 11, 27, 21, 54, 17, 0, time.UTC)
	r := Run{
		Title: "Benchmarks (make bench)", Started: start, Ended: start.Add(11*time.Minute + 3*time.Second),
		Commit: "3f0115a0c3f0115a0c3f0115a0c3f0115a0c3f01", Dirty: []string{"a.go", "b.go", "c", "d", "e", "f"},
		Cores: 2, MemoryBytes: 24 << 30, Kernel: "Linux 6.1.0-28-cloud-amd64", CPU: "AMD EPYC",
		LoadStart: "1.58 2.01 1.47", LoadEnd: "0.20 0.30 0.40", Go: "go1.26.8 linux/amd64",
		Command: "make bench", Commands: []string{"go test ./inbox", "go test ./outbox"},
		Knobs: []string{"BENCH_ROUNDS=3"}, Notes: []string{"a note"},
	}
	var b bytes.Buffer
	if err := r.WriteHeader(&b); err != nil {
		t.Fatal(err)
	}
	golden(t, "header.md", b.Bytes())

	r.Draft = "JUSTONCE_BENCH_SMALL=1: not for reading."
	r.Dirty, r.Knobs, r.Commands = nil, nil, []string{"go run ."}
	r.LoadStart, r.LoadEnd = "0.10 0.20 0.30", "0.90 0.50 0.40"
	b.Reset()
	_ = r.WriteHeader(&b)
	h := b.String()
	for _, want := range []string{
		"## Benchmarks (make bench)\n\n> **Not meant to be read.** JUSTONCE_BENCH_SMALL=1: not for reading.\n",
		", clean tree\n", "- **ran**: `go run .`\n", "- **environment**: no knob set",
	} {
		if !strings.Contains(h, want) {
			t.Errorf("header lacks %q:\n%s", want, h)
		}
	}
	if strings.Contains(h, "busy") {
		t.Errorf("a load of 0.9 on 2 cores is not busy:\n%s", h)
	}
}

func TestWriteFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "r.md")
	if err := os.WriteFile(path, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	r := Run{Title: "T", Commit: "c", Cores: 1}
	err := WriteFile(path, r, func(w io.Writer) error { _, err := io.WriteString(w, "body\n"); return err })
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(b), "## T\n") || !strings.HasSuffix(string(b), "\nbody\n") {
		t.Errorf("file:\n%s", b)
	}
	if fi, _ := os.Stat(path); fi.Mode().Perm() != 0o644 {
		t.Errorf("mode %v", fi.Mode())
	}
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(path), ".results-*"))
	if len(left) != 0 {
		t.Errorf("temporary files left: %q", left)
	}
}
