package benchresults

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// A document includes a results file between two markers:
//
//	<!-- include: results/bench.md -->
//	... the file's text, written by Include ...
//	<!-- end include -->
//
// The path is relative to the document's folder. The included text is the
// file's, its headings one level deeper, so that they nest under the
// heading the markers stand below.
var (
	includeStart = regexp.MustCompile(`(?m)^<!-- include: (\S+) -->\n`)
	includeEnd   = "<!-- end include -->"
)

// Included is one include block of a document.
type Included struct {
	Path       string // as the marker names it
	Want       []byte // what the block must hold: the file's text, headings demoted
	Have       []byte // what it holds
	start, end int    // Have's offsets in the document
}

// Includes returns the include blocks of doc, the document at docPath,
// with the text each must hold read from the files they name.
func Includes(docPath string, doc []byte) ([]Included, error) {
	var out []Included
	rest, off := doc, 0
	for {
		m := includeStart.FindSubmatchIndex(rest)
		if m == nil {
			return out, nil
		}
		name := string(rest[m[2]:m[3]])
		bodyStart := m[1]
		end := bytes.Index(rest[bodyStart:], []byte(includeEnd))
		if end < 0 {
			return nil, fmt.Errorf("%s: the include of %s at byte %d has no %q", docPath, name, off+m[0], includeEnd)
		}
		src, err := os.ReadFile(filepath.Join(filepath.Dir(docPath), filepath.FromSlash(name)))
		if err != nil {
			return nil, fmt.Errorf("%s: include: %w", docPath, err)
		}
		out = append(out, Included{Path: name, Want: demote(src), Have: rest[bodyStart : bodyStart+end],
			start: off + bodyStart, end: off + bodyStart + end})
		rest = rest[bodyStart+end+len(includeEnd):]
		off += bodyStart + end + len(includeEnd)
	}
}

// Include returns doc with every include block's text replaced by the
// file it names, as it is now.
func Include(docPath string, doc []byte) ([]byte, error) {
	inc, err := Includes(docPath, doc)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	at := 0
	for _, in := range inc {
		b.Write(doc[at:in.start])
		b.Write(in.Want)
		at = in.end
	}
	b.Write(doc[at:])
	return b.Bytes(), nil
}

// IncludeFile rewrites the document at path with its include blocks
// brought up to date, and reports whether it changed.
func IncludeFile(path string) (bool, error) {
	doc, err := os.ReadFile(path)
	if err != nil {
		return false, err
	}
	out, err := Include(path, doc)
	if err != nil {
		return false, err
	}
	if bytes.Equal(out, doc) {
		return false, nil
	}
	return true, os.WriteFile(path, out, 0o644)
}

// demote puts every ATX heading of md (outside code fences) one level
// deeper, and ends the text with a newline.
func demote(md []byte) []byte {
	lines := strings.SplitAfter(string(md), "\n")
	fence := false
	for i, l := range lines {
		t := strings.TrimSpace(l)
		if strings.HasPrefix(t, "```") {
			fence = !fence
		}
		if !fence && strings.HasPrefix(l, "#") && strings.HasPrefix(strings.TrimLeft(l, "#"), " ") {
			lines[i] = "#" + l
		}
	}
	s := strings.Join(lines, "")
	if !strings.HasSuffix(s, "\n") {
		s += "\n"
	}
	return []byte(s)
}
