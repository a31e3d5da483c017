// Package readme checks that the repository's documentation cannot rot:
// README.md, every Markdown page under docs/ (recursively) and every
// README.md of the tree.
//
//  1. Every ```go block is compiled and run by go test: it must be a run of
//     lines of an Example function's body somewhere in the repository's
//     test files (blank lines and a leading import block aside). A block
//     that is deliberately a fragment (a signature, an interface) is marked
//     with <!-- not-compiled: reason --> as the last non-blank line before
//     its fence; the test counts and lists the marked blocks.
//  2. Every relative link resolves: the file exists, and an anchor
//     (#section) names a heading of the Markdown file it points into by
//     GitHub's slug rules (lower case, spaces to '-', punctuation other
//     than '-' and '_' dropped, duplicates -1, -2, ...) or an explicit
//     <a name> / <a id>. Links with a scheme (https://...) are not fetched.
//  3. The names the text puts in code spans exist in the code: metric names
//     (justonce_...); the justonce CLI's flags (--flag, in a span or
//     paragraph that shows a justonce command, and on justonce command
//     lines of code blocks); HTTP header names (Idempotency-Key, checked
//     against the code's string literals, with headerAllowed for the few
//     the code never writes); the HTTP bridge's problem types (a slug after
//     an HTTP status or the words "problem type", and the full type URI);
//     references to the repository's Go packages (pkg.Name, pkg.Type.Field,
//     Type.Field, pkg.Type{Field: ...}, and the first column of a
//     configuration table); repository paths and go command package paths;
//     make targets.
//
// What fails today is listed in knownFailures until the text is fixed.
// Everything is read with go/parser and go/ast; nothing is built or loaded.
package readme

import (
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/justonce/justonce/harness/benchresults"
)

// root is the repository root, two folders up.
const root = "../.."

// knownFailures is TEMPORARY: what the checks find wrong in the
// documentation as it stands, each "file: name" as the failure names it,
// so that go test passes while the text is rewritten. Whoever fixes the
// text deletes the entry; an entry that no longer fails fails the test, so
// the list cannot go stale. Add nothing to it: fix the text instead.
var knownFailures = []string{}

// docFiles returns the documents checked, repository-relative: README.md,
// every .md under docs/, and every README.md of the tree.
func docFiles(t testing.TB) []string {
	t.Helper()
	set := map[string]bool{}
	err := walkRepo(root, func(_, rel string) error {
		if path.Base(rel) == "README.md" || strings.HasPrefix(rel, "docs/") && strings.HasSuffix(rel, ".md") {
			set[rel] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for f := range set {
		out = append(out, f)
	}
	sort.Strings(out)
	return out
}

var (
	indexOnce sync.Once
	index     *codeIndex
	indexErr  error
)

// repoIndex indexes the repository's code once per test binary.
func repoIndex(t testing.TB) *codeIndex {
	t.Helper()
	indexOnce.Do(func() { index, indexErr = buildIndex(root) })
	if indexErr != nil {
		t.Fatal(indexErr)
	}
	return index
}

// exampleBodies returns the body of every Example function in the
// repository's test files, one level of indentation removed, as lines.
func exampleBodies(t testing.TB) map[string][]string {
	t.Helper()
	bodies := map[string][]string{}
	err := walkRepo(root, func(p, rel string) error {
		if !strings.HasSuffix(rel, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for name, lines := range examplesIn(p, src) {
			bodies[rel+":"+name] = lines
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return bodies
}

// TestDocs runs the three checks over the documentation and compares what
// fails with knownFailures.
func TestDocs(t *testing.T) {
	x := repoIndex(t)
	bodies := exampleBodies(t)
	files := docFiles(t)
	if len(files) == 0 {
		t.Fatal("no documents found: the test is looking in the wrong place")
	}
	// Root-level Markdown besides README.md (the changelog) records old
	// names on purpose; only its Go blocks are checked, as they always were.
	others, err := filepath.Glob(filepath.Join(root, "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	goOnly := map[string]bool{}
	for _, p := range others {
		if rel := filepath.Base(p); !slices.Contains(files, rel) {
			goOnly[rel] = true
			files = append(files, rel)
		}
	}
	lc := newLinkChecker(root)
	var fails []failure
	checked, marked, links := 0, 0, 0
	kinds := map[string]int{}
	allowed := map[string]bool{}
	for _, rel := range files {
		f, err := readMarkdown(root, rel)
		if err != nil {
			t.Fatal(err)
		}
		gf, c, m := checkGoBlocks(f, bodies)
		fails = append(fails, gf...)
		checked, marked = checked+c, marked+m
		for _, fc := range f.fences {
			if fc.marked {
				t.Logf("%s:%d: Go block marked not-compiled: %s", rel, fc.line, fc.reason)
			}
		}
		if goOnly[rel] {
			continue
		}
		for _, u := range f.units {
			links += len(u.links())
		}
		fails = append(fails, lc.check(f)...)
		nf, counts, used := checkNames(f, x)
		fails = append(fails, nf...)
		for k, n := range counts {
			kinds[k] += n
		}
		for k := range used {
			allowed[k] = true
		}
	}
	if checked == 0 {
		t.Fatal("no Go blocks found: the test is looking in the wrong place")
	}
	if len(x.metrics) == 0 || len(x.flags) <= 2 || len(x.problems) == 0 {
		t.Fatalf("the index found %d metrics, %d flags, %d problem types: it is looking in the wrong place",
			len(x.metrics), len(x.flags), len(x.problems))
	}
	t.Logf("%d documents: %d Go blocks checked against %d Examples, %d marked not-compiled; %d links; names checked: %v",
		len(files)-len(goOnly), checked, len(bodies), marked, links, kinds)
	// The allow-lists cannot go stale either: each entry must be what lets
	// a name of the documents pass, and a header the code now names needs
	// none.
	for h := range headerAllowed {
		if !allowed[h] {
			t.Errorf("headerAllowed lists %q, which no document mentions: delete the entry", h)
		}
		if x.literals[h] {
			t.Errorf("headerAllowed lists %q, which the code now names: delete the entry", h)
		}
	}
	for r := range unqualifiedAllowed {
		if !allowed[r] {
			t.Errorf("unqualifiedAllowed lists %q, which no document mentions: delete the entry", r)
		}
	}
	compareKnown(t, fails, knownFailures)
}

// compareKnown reports the failures knownFailures does not list, and the
// entries of knownFailures that no longer fail.
func compareKnown(t *testing.T, fails []failure, known []string) {
	t.Helper()
	unexpected, stale, twice := diffKnown(fails, known)
	for _, f := range unexpected {
		t.Errorf("%s\n\t(known-failures name: %q)", f, f.key())
	}
	for _, k := range stale {
		t.Errorf("knownFailures lists %q, which no longer fails: delete the entry", k)
	}
	for _, k := range twice {
		t.Errorf("knownFailures lists %q twice", k)
	}
	for _, f := range fails {
		if !slices.Contains(unexpected, f) {
			t.Logf("known failure: %s", f)
		}
	}
}

// diffKnown splits fails against known: the failures known does not list,
// the entries of known that match no failure, and the entries listed twice.
func diffKnown(fails []failure, known []string) (unexpected []failure, stale, twice []string) {
	listed := map[string]bool{}
	for _, k := range known {
		if listed[k] {
			twice = append(twice, k)
		}
		listed[k] = true
	}
	hit := map[string]bool{}
	for _, f := range fails {
		if listed[f.key()] {
			hit[f.key()] = true
			continue
		}
		unexpected = append(unexpected, f)
	}
	for _, k := range known {
		if !hit[k] && !slices.Contains(stale, k) {
			stale = append(stale, k)
		}
	}
	return unexpected, stale, twice
}

// TestIncludedResultsAreUpToDate: a document that includes a results file
// (between <!-- include: … --> and <!-- end include -->) holds that file's
// text as it is now, so that the figures a page shows are the run's.
func TestIncludedResultsAreUpToDate(t *testing.T) {
	blocks := 0
	for _, rel := range docFiles(t) {
		p := filepath.Join(root, filepath.FromSlash(rel))
		doc, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		inc, err := benchresults.Includes(p, doc)
		if err != nil {
			t.Error(err)
			continue
		}
		for _, in := range inc {
			blocks++
			if string(in.Have) != string(in.Want) {
				t.Errorf("%s: the included %s is not the file as it is now: run `go run ./harness/benchresults/cmd/benchresults include %s`",
					rel, in.Path, rel)
			}
		}
	}
	t.Logf("%d include blocks checked", blocks)
}
