package httpbridge_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestReadmeSnippetsAreExamples: every Go snippet of httpbridge/README.md
// and of the top README's HTTP section is the body (or, in the top README,
// a run of lines of the body) of an Example that go test compiles and
// runs, so that the snippets compile as written.
func TestReadmeSnippetsAreExamples(t *testing.T) {
	t.Parallel()
	var bodies []string
	for _, f := range []string{"example_test.go", "../httpretry/example_test.go"} {
		bodies = append(bodies, exampleBodies(t, f)...)
	}
	own, err := os.ReadFile("README.md")
	require.NoError(t, err)
	snippets := goSnippets(string(own))
	require.NotEmpty(t, snippets)
	for _, s := range snippets {
		require.Contains(t, bodies, s, "httpbridge/README.md: this snippet is not the body of an Example")
	}

	top, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	section := string(top)
	start := strings.Index(section, "### HTTP (`httpbridge`)")
	require.GreaterOrEqual(t, start, 0, "README.md has no HTTP section")
	section = section[start+1:]
	if end := strings.Index(section, "\n#"); end >= 0 {
		section = section[:end]
	}
	snippets = goSnippets(section)
	require.NotEmpty(t, snippets)
	for _, s := range snippets {
		found := false
		for _, b := range bodies {
			found = found || strings.Contains(b, s)
		}
		require.True(t, found, "README.md HTTP section: this snippet is not part of an Example's body:\n%s", s)
	}
}

var goBlock = regexp.MustCompile("(?s)```go\n(.*?)```")

func goSnippets(md string) []string {
	var out []string
	for _, m := range goBlock.FindAllStringSubmatch(md, -1) {
		out = append(out, m[1])
	}
	return out
}

// exampleBodies returns the bodies of the Example functions in file, one
// indentation level removed.
func exampleBodies(t *testing.T, file string) []string {
	t.Helper()
	src, err := os.ReadFile(file)
	require.NoError(t, err)
	var out []string
	for _, part := range strings.Split(string(src), "\nfunc Example")[1:] {
		part = part[strings.Index(part, "{\n")+2:]
		part = part[:strings.Index(part, "\n}\n")+1]
		var b strings.Builder
		for _, line := range strings.SplitAfter(part, "\n") {
			b.WriteString(strings.TrimPrefix(line, "\t"))
		}
		out = append(out, b.String())
	}
	return out
}
