package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// These tests hold the package documentation, the help and the JSON output
// to one another: every command and flag is documented and in its help,
// the exit codes read the same in both, and every --json object has the
// keys and types the documentation shows.

// leaf is a command of the tree with the flags it defines.
type leaf struct {
	path  string // "ledger show"
	cmd   *command
	flags *flags
}

// leaves walks the command tree.
func leaves() []leaf {
	var out []leaf
	var walk func(c *command, prefix string)
	walk = func(c *command, prefix string) {
		for _, sub := range c.subs {
			if sub.subs != nil {
				walk(sub, prefix+sub.name+" ")
				continue
			}
			f := newFlags(prefix+sub.name, func(string) string { return "" })
			sub.setup(f)
			out = append(out, leaf{path: prefix + sub.name, cmd: sub, flags: f})
		}
	}
	walk(rootCommand(), "")
	return out
}

// packageDoc is the text of the package documentation's comment lines,
// without their "//" and one following space.
func packageDoc(t testing.TB) []string {
	t.Helper()
	src, err := os.ReadFile("doc.go")
	require.NoError(t, err)
	var lines []string
	for _, l := range strings.Split(string(src), "\n") {
		rest, ok := strings.CutPrefix(l, "//")
		if !ok {
			continue
		}
		lines = append(lines, strings.TrimPrefix(rest, " "))
	}
	return lines
}

// docSection returns the lines of the documentation's "# name" section.
func docSection(t testing.TB, name string) []string {
	t.Helper()
	lines := packageDoc(t)
	for i, l := range lines {
		if l != "# "+name {
			continue
		}
		end := i + 1
		for end < len(lines) && !strings.HasPrefix(lines[end], "# ") {
			end++
		}
		return lines[i+1 : end]
	}
	t.Fatalf("doc.go has no section %q", name)
	return nil
}

// documentedJSON parses the example objects of the documentation's JSON
// section: a line "\tname, name:" names commands, the indented lines that
// follow hold their object.
func documentedJSON(t testing.TB) map[string]any {
	t.Helper()
	docs := map[string]any{}
	var names []string
	var text strings.Builder
	flush := func() {
		if names == nil {
			return
		}
		var v any
		require.NoError(t, json.Unmarshal([]byte(text.String()), &v), "doc.go: the JSON of %v", names)
		for _, n := range names {
			docs[n] = v
		}
		names = nil
		text.Reset()
	}
	for _, l := range docSection(t, "JSON output") {
		body, ok := strings.CutPrefix(l, "\t")
		switch {
		case !ok:
			flush()
		case strings.HasSuffix(body, ":") && !strings.HasPrefix(body, " "):
			flush()
			names = strings.Split(strings.TrimSuffix(body, ":"), ", ")
		default:
			text.WriteString(body)
		}
	}
	flush()
	return docs
}

var snakeCase = regexp.MustCompile(`^[a-z][a-z0-9]*(_[a-z0-9]+)*$`)

// checkJSON checks the --json output of command name (e.g. "ledger show")
// against the rules of the documentation and against its documented
// example: the same keys at every level, the same types where neither value
// is null, snake_case keys, times in RFC 3339 UTC, durations in seconds.
func checkJSON(t testing.TB, name, stdout string) {
	t.Helper()
	doc, ok := documentedJSON(t)[name]
	require.True(t, ok, "doc.go documents no JSON object for %q", name)
	var got any
	dec := json.NewDecoder(strings.NewReader(stdout))
	dec.UseNumber()
	require.NoError(t, dec.Decode(&got), "%s --json: %s", name, stdout)
	require.False(t, dec.More(), "%s --json prints one value: %s", name, stdout)
	_, isObject := got.(map[string]any)
	require.True(t, isObject, "%s --json prints an object: %s", name, stdout)
	for _, p := range compareJSON(name, doc, got) {
		t.Errorf("%s --json: %s\noutput:\n%s", name, p, stdout)
	}
}

// compareJSON lists how got departs from the documented doc at path.
func compareJSON(path string, doc, got any) []string {
	var problems []string
	kind := func(v any) string {
		switch v.(type) {
		case nil:
			return "null"
		case map[string]any:
			return "object"
		case []any:
			return "array"
		case string:
			return "string"
		case bool:
			return "bool"
		default: // float64 in doc, json.Number in got
			return "number"
		}
	}
	key := path[strings.LastIndex(path, ".")+1:]
	switch {
	case strings.HasSuffix(key, "_at") || strings.HasSuffix(key, "_until"):
		if s, ok := got.(string); ok {
			ts, err := time.Parse(time.RFC3339Nano, s)
			if err != nil || ts.Location() != time.UTC || !strings.HasSuffix(s, "Z") {
				problems = append(problems, fmt.Sprintf("%s: %q is not an RFC 3339 time in UTC", path, s))
			}
		} else if got != nil {
			problems = append(problems, fmt.Sprintf("%s: a time is a string or null, not %s", path, kind(got)))
		}
	case strings.HasSuffix(key, "_seconds"):
		if k := kind(got); k != "number" && k != "null" {
			problems = append(problems, fmt.Sprintf("%s: a duration is a number of seconds, not %s", path, k))
		}
	case strings.Contains(key, "duration") || strings.HasSuffix(key, "_ms") || key == "took":
		problems = append(problems, fmt.Sprintf("%s: durations are in keys ending in _seconds", path))
	}
	if got == nil || doc == nil {
		return problems
	}
	if kind(doc) != kind(got) {
		return append(problems, fmt.Sprintf("%s: documented as %s, printed as %s", path, kind(doc), kind(got)))
	}
	switch g := got.(type) {
	case map[string]any:
		d := doc.(map[string]any)
		for k := range g {
			if !snakeCase.MatchString(k) {
				problems = append(problems, fmt.Sprintf("%s: key %q is not snake_case", path, k))
			}
			if _, ok := d[k]; !ok {
				problems = append(problems, fmt.Sprintf("%s: key %q is not documented", path, k))
			}
		}
		for _, k := range sortedKeys(d) {
			if _, ok := g[k]; !ok {
				problems = append(problems, fmt.Sprintf("%s: documented key %q is missing", path, k))
				continue
			}
			problems = append(problems, compareJSON(path+"."+k, d[k], g[k])...)
		}
	case []any:
		d := doc.([]any)
		for i, e := range g {
			if len(d) > 0 {
				problems = append(problems, compareJSON(fmt.Sprintf("%s[%d]", path, i), d[0], e)...)
			}
		}
	}
	return problems
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// TestDocumented: every command and flag is in the package documentation;
// every command with --json has its object documented, and only those.
func TestDocumented(t *testing.T) {
	t.Parallel()
	doc := strings.Join(packageDoc(t), "\n")
	commands := strings.Join(docSection(t, "Commands"), "\n")
	jsonDocs := documentedJSON(t)
	withJSON := map[string]bool{}
	for _, l := range leaves() {
		require.Contains(t, commands, "justonce "+l.path+" ", "doc.go lists the command")
		l.flags.VisitAll(func(fl *flag.Flag) {
			require.Contains(t, doc, "--"+fl.Name, "doc.go names the flag of %s", l.path)
		})
		if l.flags.Lookup("json") != nil {
			withJSON[l.path] = true
			require.Contains(t, jsonDocs, l.path, "doc.go documents the JSON of %s", l.path)
		}
	}
	for name := range jsonDocs {
		require.True(t, withJSON[name], "doc.go documents JSON for %q, which has no --json", name)
	}
	// The environment: every variable a flag reads is in the top-level
	// help's list and in the documentation's, and only those.
	config := strings.Join(docSection(t, "Configuration"), "\n")
	helpEnv := map[string]bool{}
	for _, e := range environment {
		helpEnv[e.name] = true
		require.Contains(t, config, " "+e.name+" ", "doc.go names the variable")
	}
	read := map[string]bool{}
	for _, l := range leaves() {
		for _, env := range l.flags.env {
			read[env] = true
			require.True(t, helpEnv[env], "the top-level help lists %s", env)
		}
	}
	require.Len(t, read, len(helpEnv), "the top-level help lists only variables a flag reads")
	// Each example follows the rules it documents.
	for name, v := range jsonDocs {
		for _, p := range compareJSON(name, v, v) {
			t.Errorf("doc.go: %s", p)
		}
		out, err := json.Marshal(v)
		require.NoError(t, err)
		checkJSON(t, name, string(out))
	}
}

// TestExitCodes: the documentation and the top-level help list the same
// exit codes, with the same words.
func TestExitCodes(t *testing.T) {
	t.Parallel()
	var help bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-h"}, &help, &bytes.Buffer{}, func(string) string { return "" }))
	var documented []string
	for _, l := range docSection(t, "Exit codes") {
		if body, ok := strings.CutPrefix(l, "\t"); ok {
			documented = append(documented, body)
		}
	}
	var listed []string
	for _, e := range exitCodes {
		line := fmt.Sprintf("%d  %s", e.code, e.text)
		listed = append(listed, line)
		require.Contains(t, help.String(), "\n  "+line+"\n")
	}
	require.Equal(t, listed, documented, "doc.go's exit codes")
	for i, code := range []int{exitOK, exitFailure, exitUsage, exitNotFound, exitCacheStale} {
		require.Equal(t, i, code)
		require.Equal(t, code, exitCodes[i].code)
	}
}

// TestLeafJSONFlag: every command that prints a result has --json, with
// the same text.
func TestLeafJSONFlag(t *testing.T) {
	t.Parallel()
	want := newFlags("x", func(string) string { return "" })
	want.jsonFlag()
	for _, l := range leaves() {
		fl := l.flags.Lookup("json")
		require.NotNil(t, fl, "%s has --json", l.path)
		require.Equal(t, want.Lookup("json").Usage, fl.Usage, l.path)
	}
}
