// Package readme checks that the Go snippets of the repository's READMEs
// are compiled and run by go test: each one must be a run of lines of an
// Example function's body.
package readme

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// root is the repository root, two folders up.
const root = "../.."

// exampleBodies returns the body of every Example function in the
// repository's test files, one level of indentation removed, as lines.
func exampleBodies(t *testing.T) map[string][]string {
	t.Helper()
	bodies := map[string][]string{}
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, src, parser.ParseComments)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !strings.HasPrefix(fn.Name.Name, "Example") || fn.Body == nil {
				continue
			}
			body := string(src[fset.Position(fn.Body.Lbrace).Offset+1 : fset.Position(fn.Body.Rbrace).Offset])
			var lines []string
			for _, l := range strings.Split(body, "\n") {
				lines = append(lines, strings.TrimPrefix(l, "\t"))
			}
			bodies[path+":"+fn.Name.Name] = lines
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return bodies
}

// snippets returns the ```go blocks of a Markdown file, without the
// import block a snippet may open with (imports are not in a body).
func snippets(md string) [][]string {
	var out [][]string
	var cur []string
	in := false
	for _, l := range strings.Split(md, "\n") {
		switch {
		case !in && strings.TrimSpace(l) == "```go":
			in, cur = true, nil
		case in && strings.TrimSpace(l) == "```":
			in = false
			out = append(out, dropImports(cur))
		case in:
			cur = append(cur, l)
		}
	}
	return out
}

func dropImports(lines []string) []string {
	if len(lines) == 0 || !strings.HasPrefix(lines[0], "import (") {
		return lines
	}
	for i, l := range lines {
		if l == ")" {
			return lines[i+1:]
		}
	}
	return lines
}

// nonBlank drops blank lines.
func nonBlank(lines []string) []string {
	var out []string
	for _, l := range lines {
		if strings.TrimSpace(l) != "" {
			out = append(out, l)
		}
	}
	return out
}

// contains reports whether want is a contiguous run of have (blank lines
// ignored on both sides).
func contains(have, want []string) bool {
	have, want = nonBlank(have), nonBlank(want)
	if len(want) == 0 {
		return true
	}
	for i := 0; i+len(want) <= len(have); i++ {
		ok := true
		for j := range want {
			if have[i+j] != want[j] {
				ok = false
				break
			}
		}
		if ok {
			return true
		}
	}
	return false
}

func TestReadmeSnippetsAreExamples(t *testing.T) {
	bodies := exampleBodies(t)
	mds, err := filepath.Glob(filepath.Join(root, "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	more, err := filepath.Glob(filepath.Join(root, "*", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, md := range append(mds, more...) {
		src, err := os.ReadFile(md)
		if err != nil {
			t.Fatal(err)
		}
		for i, s := range snippets(string(src)) {
			checked++
			found := false
			for _, b := range bodies {
				if contains(b, s) {
					found = true
					break
				}
			}
			if !found {
				t.Errorf("%s: Go snippet %d is not a run of lines of any Example's body, so go test does not compile it:\n%s",
					md, i+1, strings.Join(s, "\n"))
			}
		}
	}
	if checked == 0 {
		t.Fatal("no Go snippets found: the test is looking in the wrong place")
	}
	t.Logf("%d Go snippets checked against %d Examples", checked, len(bodies))
}
