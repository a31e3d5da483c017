package readme

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
)

// These tests show, on small Markdown files in testdata/, that each check
// catches what it is for: every bad fixture marks each name that must fail
// with <!-- want: kind: name --> on the line the failure names, and the
// check must report exactly those; the good fixtures must pass.

const fixtures = "testdata"

var wantComment = regexp.MustCompile(`<!-- want: (.+?): (.+?) -->`)

// wants returns the failures a fixture expects, as "line: kind: name".
func wants(t *testing.T, rel string) []string {
	t.Helper()
	src, err := os.ReadFile(filepath.Join(fixtures, filepath.FromSlash(rel)))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for i, l := range strings.Split(string(src), "\n") {
		for _, m := range wantComment.FindAllStringSubmatch(l, -1) {
			out = append(out, fmt.Sprintf("%d: %s: %s", i+1, m[1], m[2]))
		}
	}
	sort.Strings(out)
	return out
}

// got returns failures as "line: kind: name".
func got(fails []failure) []string {
	var out []string
	for _, f := range fails {
		out = append(out, fmt.Sprintf("%d: %s: %s", f.line, f.kind, f.name))
	}
	sort.Strings(out)
	return out
}

func sameFailures(t *testing.T, rel string, fails []failure) {
	t.Helper()
	want, have := wants(t, rel), got(fails)
	if !slices.Equal(want, have) {
		t.Errorf("%s:\nwant %d failures:\n\t%s\ngot %d:\n\t%s", rel, len(want), strings.Join(want, "\n\t"),
			len(have), strings.Join(have, "\n\t"))
		for _, f := range fails {
			t.Logf("%s", f)
		}
	}
}

func fixture(t *testing.T, rel string) *mdFile {
	t.Helper()
	f, err := readMarkdown(fixtures, rel)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// nameKinds are the kinds of names the documents are checked for.
var nameKinds = []string{"metric", "flag", "header", "problem type", "identifier", "path", "make target"}

func TestNamesGoodFixturePasses(t *testing.T) {
	fails, checked, _ := checkNames(fixture(t, "names/good.md"), repoIndex(t))
	for _, f := range fails {
		t.Errorf("names/good.md must pass: %s", f)
	}
	// Passing means something: each kind was looked up.
	for _, k := range nameKinds {
		if checked[k] == 0 {
			t.Errorf("names/good.md: no %s was checked", k)
		}
	}
	t.Logf("checked: %v", checked)
}

func TestNamesBadFixtureFails(t *testing.T) {
	fails, _, _ := checkNames(fixture(t, "names/bad.md"), repoIndex(t))
	sameFailures(t, "names/bad.md", fails)
	for _, k := range nameKinds {
		if !slices.ContainsFunc(fails, func(f failure) bool { return f.kind == k }) {
			t.Errorf("names/bad.md shows no %s caught", k)
		}
	}
}

func TestLinksFixtures(t *testing.T) {
	lc := newLinkChecker(fixtures)
	for _, good := range []string{"links/good.md", "links/sub/page.md", "links/target.md"} {
		f := fixture(t, good)
		n := 0
		for _, u := range f.units {
			n += len(u.links())
		}
		for _, fl := range lc.check(f) {
			t.Errorf("%s must pass: %s", good, fl)
		}
		t.Logf("%s: %d links", good, n)
	}
	sameFailures(t, "links/bad.md", lc.check(fixture(t, "links/bad.md")))
}

func TestGoBlocksFixture(t *testing.T) {
	src, err := os.ReadFile(filepath.Join(fixtures, "goblocks", "example_test.go"))
	if err != nil {
		t.Fatal(err)
	}
	bodies := examplesIn("example_test.go", src)
	if len(bodies) != 1 {
		t.Fatalf("the fixture's Examples: %v", bodies)
	}
	fails, checked, marked := checkGoBlocks(fixture(t, "goblocks/doc.md"), bodies)
	sameFailures(t, "goblocks/doc.md", fails)
	// Checked: the imports-and-body block, the out-of-order one and the
	// one in a list item; the sh block is not Go. Marked: two with a
	// reason, one without.
	if checked != 3 || marked != 3 {
		t.Errorf("checked %d Go blocks, %d marked; want 3 and 3", checked, marked)
	}
}

func TestKnownFailuresCannotGoStale(t *testing.T) {
	fails := []failure{
		{file: "README.md", line: 3, kind: "flag", name: "--nope"},
		{file: "README.md", line: 9, kind: "flag", name: "--nope"},
		{file: "docs/A.md", line: 1, kind: "metric", name: "justonce_x"},
	}
	unexpected, stale, twice := diffKnown(fails, []string{"README.md: --nope", "README.md: --fixed", "README.md: --fixed"})
	if len(unexpected) != 1 || unexpected[0].key() != "docs/A.md: justonce_x" {
		t.Errorf("unexpected: %v; want the one failure not listed", unexpected)
	}
	if !slices.Equal(stale, []string{"README.md: --fixed"}) {
		t.Errorf("stale: %v; want the entry that no longer fails", stale)
	}
	if !slices.Equal(twice, []string{"README.md: --fixed"}) {
		t.Errorf("twice: %v", twice)
	}
}

func TestSlug(t *testing.T) {
	for _, c := range []struct{ heading, slug string }{
		{"Two commands", "two-commands"},
		{"Quickstart (2 minutes)", "quickstart-2-minutes"},
		{"Guarantees, and where they stop", "guarantees-and-where-they-stop"},
		{"### `inbox.Config`", "inboxconfig"},
		{"Consumer runtime (`consumer.Config`)", "consumer-runtime-consumerconfig"},
		{"Command line (`go run ./cmd/justonce`)", "command-line-go-run-cmdjustonce"},
		{"kafkainbox — package `kafkainbox`", "kafkainbox--package-kafkainbox"},
		{"Retention vs. redelivery horizon", "retention-vs-redelivery-horizon"},
		{"The [linked](https://example.com) *emphasis* and __strong__ words", "the-linked-emphasis-and-strong-words"},
		{"snake_case and `snake_case`", "snake_case-and-snake_case"},
		{"A <code>tag</code>", "a-tag"},
	} {
		h := strings.TrimLeft(c.heading, "# ")
		if got := slug(headingText(h)); got != c.slug {
			t.Errorf("slug(%q) = %q, want %q", c.heading, got, c.slug)
		}
	}
}

func TestCodeSpans(t *testing.T) {
	text := "a `one` b ``two `tick` here`` c `multi\nline` d `` `x` `` e \\`escaped f ``unclosed"
	var have []string
	for _, s := range codeSpans(text, 10) {
		have = append(have, fmt.Sprintf("%d:%s", s.line, s.text))
	}
	want := []string{"10:one", "10:two `tick` here", "10:multi line", "11:`x`"}
	if !slices.Equal(have, want) {
		t.Errorf("codeSpans = %q, want %q", have, want)
	}
}
