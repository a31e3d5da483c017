package benchresults

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestIncludeBringsBlocksUpToDate(t *testing.T) {
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "results"), 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(name, text string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("results/a.md", "## Run A\n\n```sh\n# a comment, not a heading\n```\n\n### ./inbox\n\n| x | 1 |\n")
	write("results/b.md", "## Run B\nno newline at the end")
	doc := "# Page\n\n<!-- include: results/a.md -->\nstale text\n<!-- end include -->\n\nbetween\n\n<!-- include: results/b.md -->\n<!-- end include -->\nafter\n"
	path := filepath.Join(dir, "page.md")
	write("page.md", doc)

	changed, err := IncludeFile(path)
	if err != nil || !changed {
		t.Fatalf("IncludeFile: changed %v, err %v", changed, err)
	}
	got, _ := os.ReadFile(path)
	want := "# Page\n\n<!-- include: results/a.md -->\n### Run A\n\n```sh\n# a comment, not a heading\n```\n\n#### ./inbox\n\n| x | 1 |\n<!-- end include -->\n\nbetween\n\n<!-- include: results/b.md -->\n### Run B\nno newline at the end\n<!-- end include -->\nafter\n"
	if string(got) != want {
		t.Fatalf("included:\n%s\nwant:\n%s", got, want)
	}
	inc, err := Includes(path, got)
	if err != nil || len(inc) != 2 {
		t.Fatalf("Includes: %d blocks, err %v", len(inc), err)
	}
	for _, in := range inc {
		if string(in.Have) != string(in.Want) {
			t.Errorf("%s: block not up to date after IncludeFile", in.Path)
		}
	}
	if changed, err := IncludeFile(path); err != nil || changed {
		t.Fatalf("a second IncludeFile changed %v, err %v; want no change", changed, err)
	}

	// A results file that moves on makes the block stale.
	write("results/b.md", "## Run B, again\n")
	inc, _ = Includes(path, got)
	if string(inc[1].Have) == string(inc[1].Want) {
		t.Fatal("a block whose file changed still reads as up to date")
	}
}

func TestIncludeRefusesAnOpenBlockOrAMissingFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "page.md")
	if _, err := Include(path, []byte("<!-- include: results/none.md -->\n<!-- end include -->\n")); err == nil || !strings.Contains(err.Error(), "none.md") {
		t.Fatalf("a missing file: err %v", err)
	}
	if _, err := Includes(path, []byte("<!-- include: results/a.md -->\ntext\n")); err == nil || !strings.Contains(err.Error(), "end include") {
		t.Fatalf("an open block: err %v", err)
	}
}
