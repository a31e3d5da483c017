package benchresults

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// ResultsDir is the folder, relative to the repository root, of the
// results files meant for the documentation. Changes under it do not make
// a run's tree count as dirty: they are what the runs write.
const ResultsDir = "docs/results"

// Run is what a results file says about the run that made it.
type Run struct {
	// Title is the heading of the file.
	Title string `json:"title"`
	// Draft, when set, says why the numbers are not meant to be read (a
	// small or partial run); the file then opens with it.
	Draft string `json:"draft,omitempty"`

	Started time.Time `json:"started"`
	Ended   time.Time `json:"ended"`

	// Commit is the HEAD commit of the repository, or why it is unknown.
	Commit string `json:"commit"`
	// Dirty lists the paths with uncommitted changes (outside ResultsDir)
	// when the run started; empty when the tree was clean.
	Dirty []string `json:"dirty,omitempty"`

	Cores       int    `json:"cores"`
	MemoryBytes uint64 `json:"memory_bytes"`
	Kernel      string `json:"kernel"`
	CPU         string `json:"cpu"`
	// LoadStart and LoadEnd are the 1, 5 and 15 minute load averages.
	LoadStart string `json:"load_start"`
	LoadEnd   string `json:"load_end"`

	Go string `json:"go"`
	// Command is the command as the user ran it; Commands, what it ran
	// in turn (one go test per area, say).
	Command  string   `json:"command"`
	Commands []string `json:"commands,omitempty"`
	// Knobs are the environment variables that set the run (NAME=value).
	Knobs []string `json:"knobs,omitempty"`
	// Notes are further lines of the header (a failure, say).
	Notes []string `json:"notes,omitempty"`
}

// Begin returns a Run started now in the repository at root: its date,
// commit, machine, load average and Go version.
func Begin(root string) Run {
	r := Run{
		Started:   time.Now().UTC(),
		Cores:     runtime.NumCPU(),
		Kernel:    kernel(),
		LoadStart: loadAvg(),
		Go:        runtime.Version() + " " + runtime.GOOS + "/" + runtime.GOARCH,
	}
	r.Commit, r.Dirty = gitState(root)
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		r.MemoryBytes = memTotal(string(b))
	}
	r.CPU = "unknown"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		if m := cpuModel(string(b)); m != "" {
			r.CPU = m
		}
	}
	return r
}

// End records the end of the run: its date and the load average.
func (r *Run) End() {
	r.Ended = time.Now().UTC()
	r.LoadEnd = loadAvg()
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func kernel() string {
	typ, err1 := os.ReadFile("/proc/sys/kernel/ostype")
	rel, err2 := os.ReadFile("/proc/sys/kernel/osrelease")
	if err1 != nil || err2 != nil {
		return runtime.GOOS
	}
	return strings.TrimSpace(string(typ)) + " " + strings.TrimSpace(string(rel))
}

// memTotal reads MemTotal from the text of /proc/meminfo, in bytes.
func memTotal(meminfo string) uint64 {
	for line := range strings.Lines(meminfo) {
		if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			f := strings.Fields(rest)
			if len(f) == 0 {
				return 0
			}
			kb, err := strconv.ParseUint(f[0], 10, 64)
			if err != nil {
				return 0
			}
			return kb * 1024
		}
	}
	return 0
}

// cpuModel reads the CPU model from the text of /proc/cpuinfo: the first
// "model name" (x86), else "Model" or "Hardware" (ARM boards), else
// "cpu" (POWER).
func cpuModel(cpuinfo string) string {
	found := map[string]string{}
	for line := range strings.Lines(cpuinfo) {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		k, v = strings.TrimSpace(k), strings.Join(strings.Fields(v), " ")
		if _, seen := found[k]; !seen && v != "" {
			found[k] = v
		}
	}
	for _, k := range []string{"model name", "Model", "Hardware", "cpu"} {
		if v := found[k]; v != "" {
			return v
		}
	}
	return ""
}

// gitState returns the HEAD commit of the repository at root and the
// paths with uncommitted changes, tracked or not (ignored files aside),
// outside ResultsDir.
func gitState(root string) (commit string, dirty []string) {
	git := func(args ...string) (string, error) {
		var out, errOut bytes.Buffer
		cmd := exec.Command("git", append([]string{"-C", root}, args...)...)
		cmd.Stdout, cmd.Stderr = &out, &errOut
		if err := cmd.Run(); err != nil {
			if msg := strings.TrimSpace(errOut.String()); msg != "" {
				return "", errors.New(msg)
			}
			return "", err
		}
		return out.String(), nil
	}
	head, err := git("rev-parse", "HEAD")
	if err != nil {
		return "unknown (" + firstLine(err.Error()) + ")", nil
	}
	status, err := git("status", "--porcelain=v1", "--", ".", ":(exclude)"+ResultsDir)
	if err != nil {
		return strings.TrimSpace(head), []string{"unknown (" + firstLine(err.Error()) + ")"}
	}
	for line := range strings.Lines(status) {
		line = strings.TrimRight(line, "\n")
		if len(line) > 3 {
			dirty = append(dirty, line[3:])
		}
	}
	return strings.TrimSpace(head), dirty
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// Knobs returns the variables of env (NAME=value, as os.Environ) whose
// name is one of names, or starts with one that ends in "*", sorted.
func Knobs(env []string, names ...string) []string {
	var out []string
	for _, kv := range env {
		name, _, ok := strings.Cut(kv, "=")
		if !ok {
			continue
		}
		for _, n := range names {
			if p, prefix := strings.CutSuffix(n, "*"); (prefix && strings.HasPrefix(name, p)) || name == n {
				out = append(out, kv)
				break
			}
		}
	}
	slices.Sort(out)
	return out
}

// RepoRoot returns the root of the justonce repository: the nearest
// directory, up from dir, that holds scripts/bench.sh.
func RepoRoot(dir string) (string, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "scripts", "bench.sh")); err == nil {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("no justonce repository (scripts/bench.sh) above %s", dir)
		}
	}
}

// busy says whether the machine was busy: a load average over one minute
// above half its cores at the start or the end.
func (r Run) busy() bool {
	for _, l := range []string{r.LoadStart, r.LoadEnd} {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(f[0], 64); err == nil && r.Cores > 0 && v > float64(r.Cores)/2 {
			return true
		}
	}
	return false
}

// WriteHeader writes the heading and the header of a results file.
func (r Run) WriteHeader(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "## %s\n\n", r.Title)
	if r.Draft != "" {
		fmt.Fprintf(&b, "> **Not meant to be read.** %s\n\n", r.Draft)
	}
	fmt.Fprintf(&b, "<!-- Written by the run described below; do not edit by hand. -->\n\n")
	took := r.Ended.Sub(r.Started).Round(time.Second)
	fmt.Fprintf(&b, "- **date (UTC)**: %s to %s (%s)\n", r.Started.Format("2006-01-02 15:04:05"), r.Ended.Format("15:04:05"), took)
	commit := "`" + r.Commit + "`"
	if strings.HasPrefix(r.Commit, "unknown") {
		commit = r.Commit
	}
	switch n := len(r.Dirty); {
	case n == 0:
		commit += ", clean tree"
	default:
		shown := r.Dirty[:min(n, 5)]
		more := ""
		if n > len(shown) {
			more = fmt.Sprintf(" and %d more", n-len(shown))
		}
		commit += fmt.Sprintf(", **dirty tree**: %d uncommitted path(s): %s%s", n, code(shown), more)
	}
	fmt.Fprintf(&b, "- **commit**: %s\n", commit)
	fmt.Fprintf(&b, "- **machine**: %d cores, %.1f GiB memory, %s, %s\n", r.Cores, float64(r.MemoryBytes)/(1<<30), r.Kernel, r.CPU)
	fmt.Fprintf(&b, "- **load average** (1, 5, 15 min): %s at the start, %s at the end\n", r.LoadStart, r.LoadEnd)
	if r.busy() {
		fmt.Fprintf(&b, "- **the machine was busy** (load above half its cores): absolute rates and latencies are lower and noisier than on a quiet machine; compare the ratios\n")
	}
	fmt.Fprintf(&b, "- **Go**: %s\n", r.Go)
	fmt.Fprintf(&b, "- **command**: `%s`\n", r.Command)
	if len(r.Commands) == 1 {
		fmt.Fprintf(&b, "- **ran**: `%s`\n", r.Commands[0])
	} else if len(r.Commands) > 1 {
		fmt.Fprintf(&b, "- **ran**:\n")
		for _, c := range r.Commands {
			fmt.Fprintf(&b, "  - `%s`\n", c)
		}
	}
	if len(r.Knobs) == 0 {
		fmt.Fprintf(&b, "- **environment**: no knob set (all at their defaults)\n")
	} else {
		fmt.Fprintf(&b, "- **environment**: %s (the others at their defaults)\n", code(r.Knobs))
	}
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	b.WriteString("\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// code formats each string as inline code, comma-separated.
func code(xs []string) string {
	q := make([]string, len(xs))
	for i, x := range xs {
		q[i] = "`" + strings.ReplaceAll(x, "`", "'") + "`"
	}
	return strings.Join(q, ", ")
}

// WriteFile writes a results file: the header of r, then body. It
// replaces path whole (a temporary file renamed), so that a reader never
// sees half a file; the folder must exist.
func WriteFile(path string, r Run, body func(io.Writer) error) error {
	var b bytes.Buffer
	if err := r.WriteHeader(&b); err != nil {
		return err
	}
	if err := body(&b); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".results-*.md")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b.Bytes()); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
