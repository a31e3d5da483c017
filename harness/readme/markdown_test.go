package readme

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"unicode"
)

// This file reads Markdown the way the checks need it: fenced code blocks
// (with the marker that may precede them), text units (a heading, a
// paragraph, a list item, a table row) and the code spans and links in
// them. It is not a full CommonMark parser; it covers what the project's
// documentation uses and errs towards finding too little rather than
// misreading prose.

// notCompiled is the HTML comment that marks the Go block after it as a
// deliberate fragment (a type signature, an interface): it must be the last
// non-blank line before the fence, with a reason.
var notCompiled = regexp.MustCompile(`^\s*<!--\s*not-compiled:\s*(.*?)\s*-->\s*$`)

// mdFile is one Markdown file, read.
type mdFile struct {
	path   string // as given to readMarkdown: repository-relative, slash-separated
	lines  []string
	fences []fence
	units  []unit
}

// fence is a fenced (or indented) code block.
type fence struct {
	line     int      // 1-based line of the opening fence
	info     string   // the info string's first word, lower case, e.g. "go", "sh"; "" for none
	body     []string // the lines between the fences, as written
	marked   bool     // preceded by a not-compiled marker
	reason   string   // the marker's reason
	indented bool     // an indented code block (no fence)
}

// unit is a heading, a paragraph, a list item or a table row: the context
// in which a code span is read.
type unit struct {
	line     int // 1-based line of the unit's first line
	text     string
	heading  int      // 1..6 for a heading, else 0
	headings []string // the enclosing headings' text, outermost first (for a heading: its ancestors)
	table    *table   // the table a row belongs to, else nil
	row      int      // the row's index in its table (0: the header)
}

// table is a Markdown table: its header cells.
type table struct {
	header []string
}

// span is a code span of a unit.
type span struct {
	text       string // content, newlines as spaces, one padding space stripped
	line       int    // 1-based line where it opens
	start, end int    // byte offsets of the span (backticks included) in the unit's text
}

var (
	fenceOpen  = regexp.MustCompile("^\\s*(`{3,}|~{3,})\\s*([^`\\s]*)")
	atxHeading = regexp.MustCompile(`^ {0,3}(#{1,6})(?:\s+(.*?))?\s*$`)
	listItem   = regexp.MustCompile(`^\s*(?:[-*+]|\d+[.)])\s+`)
	setextLine = regexp.MustCompile(`^ {0,3}(=+|-+)\s*$`)
	tableRow   = regexp.MustCompile(`^\s*\|`)
)

// readMarkdown reads the file at filepath.Join(root, rel).
func readMarkdown(root, rel string) (*mdFile, error) {
	src, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(rel)))
	if err != nil {
		return nil, err
	}
	return parseMarkdown(rel, string(src)), nil
}

// parseMarkdown splits src into fences and units.
func parseMarkdown(path, src string) *mdFile {
	f := &mdFile{path: path, lines: strings.Split(strings.ReplaceAll(src, "\r\n", "\n"), "\n")}
	var (
		cur       *unit
		curLines  []string
		headings  [6]string
		curTable  *table
		tableRows int
		lastText  string // the last non-blank line, for the not-compiled marker
		inList    bool   // the last unit was a list item (indented lines continue it)
		inComment bool   // inside an HTML comment that spans lines
	)
	flush := func() {
		if cur != nil {
			cur.text = strings.Join(curLines, "\n")
			f.units = append(f.units, *cur)
		}
		cur, curLines = nil, nil
	}
	enclosing := func(level int) []string {
		var out []string
		for i := 0; i < level && i < 6; i++ {
			if headings[i] != "" {
				out = append(out, headings[i])
			}
		}
		return out
	}
	setHeading := func(level int, text string) {
		headings[level-1] = text
		for i := level; i < 6; i++ {
			headings[i] = ""
		}
	}
	for i := 0; i < len(f.lines); i++ {
		raw := f.lines[i]
		n := i + 1
		// What GitHub renders: HTML comments are not (a comment line ends
		// a paragraph, as a blank line does). Blanking keeps offsets.
		var l string
		l, inComment = hideComments(raw, inComment)
		if m := fenceOpen.FindStringSubmatch(l); m != nil {
			flush()
			curTable = nil
			fc := fence{line: n, info: strings.ToLower(m[2])}
			if mm := notCompiled.FindStringSubmatch(lastText); mm != nil {
				fc.marked, fc.reason = true, mm[1]
			}
			mark := m[1]
			// A fence indented (in a list item) takes that much
			// indentation off its lines, as CommonMark does.
			indent := len(l) - len(strings.TrimLeft(l, " "))
			for i++; i < len(f.lines); i++ {
				t := strings.TrimSpace(f.lines[i])
				if strings.HasPrefix(t, mark) && strings.Trim(t, mark[:1]) == "" {
					break
				}
				body := f.lines[i]
				for k := 0; k < indent && strings.HasPrefix(body, " "); k++ {
					body = body[1:]
				}
				fc.body = append(fc.body, body)
			}
			f.fences = append(f.fences, fc)
			lastText, inList = "```", false
			continue
		}
		if strings.TrimSpace(l) == "" {
			flush()
			curTable = nil
			if strings.TrimSpace(raw) != "" {
				lastText = raw // a comment: perhaps the not-compiled marker
			}
			continue
		}
		// An indented code block: indented by four, after a blank line,
		// not continuing a list item.
		if cur == nil && !inList && (strings.HasPrefix(l, "    ") || strings.HasPrefix(l, "\t")) {
			fc := fence{line: n, indented: true}
			for ; i < len(f.lines); i++ {
				t := f.lines[i]
				if strings.TrimSpace(t) != "" && !strings.HasPrefix(t, "    ") && !strings.HasPrefix(t, "\t") {
					i--
					break
				}
				fc.body = append(fc.body, t)
			}
			f.fences = append(f.fences, fc)
			lastText = "    "
			continue
		}
		lastText = l
		if m := atxHeading.FindStringSubmatch(l); m != nil {
			flush()
			curTable = nil
			level := len(m[1])
			text := strings.TrimRight(strings.TrimRight(m[2], "#"), " ")
			f.units = append(f.units, unit{line: n, text: text, heading: level, headings: enclosing(level - 1)})
			setHeading(level, text)
			inList = false
			continue
		}
		if m := setextLine.FindStringSubmatch(l); m != nil && cur != nil && cur.table == nil && len(curLines) == 1 && !listItem.MatchString(curLines[0]) {
			level := 1
			if m[1][0] == '-' {
				level = 2
			}
			cur.heading, cur.headings = level, enclosing(level-1)
			text := strings.TrimSpace(curLines[0])
			flush()
			setHeading(level, text)
			f.units[len(f.units)-1].text = text
			continue
		}
		if tableRow.MatchString(l) {
			flush()
			cells := splitRow(l)
			if curTable == nil {
				curTable, tableRows = &table{header: cells}, 0
			} else {
				tableRows++
			}
			if isDelimiterRow(cells) {
				continue
			}
			f.units = append(f.units, unit{line: n, text: l, headings: enclosing(6), table: curTable, row: tableRows})
			continue
		}
		curTable = nil
		if listItem.MatchString(l) {
			flush()
			inList = true
		} else if cur == nil {
			inList = false
		}
		if cur == nil {
			cur = &unit{line: n, headings: enclosing(6)}
		}
		curLines = append(curLines, l)
	}
	flush()
	return f
}

var htmlComment = regexp.MustCompile(`<!--.*?-->`)

// hideComments blanks the HTML comments of a line; inComment says whether
// the line starts inside one, and the result whether the next line does.
func hideComments(line string, inComment bool) (string, bool) {
	blank := func(s string) string { return strings.Repeat(" ", len(s)) }
	if inComment {
		end := strings.Index(line, "-->")
		if end < 0 {
			return blank(line), true
		}
		line = blank(line[:end+3]) + line[end+3:]
	}
	line = htmlComment.ReplaceAllStringFunc(line, blank)
	if open := strings.Index(line, "<!--"); open >= 0 {
		return line[:open] + blank(line[open:]), true
	}
	return line, false
}

// splitRow splits a table row into its cells, trimmed; a '|' inside a code
// span or escaped as "\|" does not split.
func splitRow(l string) []string {
	l = strings.TrimSpace(l)
	l = strings.TrimPrefix(l, "|")
	if strings.HasSuffix(l, "|") && !strings.HasSuffix(l, `\|`) {
		l = l[:len(l)-1]
	}
	var cells []string
	var b strings.Builder
	ticks := 0
	for i := 0; i < len(l); i++ {
		c := l[i]
		switch {
		case c == '\\' && i+1 < len(l) && l[i+1] == '|':
			b.WriteString(`\|`)
			i++
		case c == '`':
			j := i
			for j < len(l) && l[j] == '`' {
				j++
			}
			switch {
			case ticks == 0:
				ticks = j - i
			case ticks == j-i:
				ticks = 0
			}
			b.WriteString(l[i:j])
			i = j - 1
		case c == '|' && ticks == 0:
			cells = append(cells, strings.TrimSpace(b.String()))
			b.Reset()
		default:
			b.WriteByte(c)
		}
	}
	return append(cells, strings.TrimSpace(b.String()))
}

var delimiterCell = regexp.MustCompile(`^:?-+:?$`)

func isDelimiterRow(cells []string) bool {
	for _, c := range cells {
		if !delimiterCell.MatchString(c) {
			return false
		}
	}
	return len(cells) > 0
}

// codeSpans returns the code spans of text, a unit's text starting at line
// first.
func codeSpans(text string, first int) []span {
	var out []span
	for i := 0; i < len(text); i++ {
		if text[i] == '\\' {
			i++ // an escaped character, a backtick included, opens nothing
			continue
		}
		if text[i] != '`' {
			continue
		}
		j := i
		for j < len(text) && text[j] == '`' {
			j++
		}
		n := j - i
		// Find the closing run of exactly n backticks.
		end := -1
		for k := j; k < len(text); {
			if text[k] != '`' {
				k++
				continue
			}
			m := k
			for m < len(text) && text[m] == '`' {
				m++
			}
			if m-k == n {
				end = k
				break
			}
			k = m
		}
		if end < 0 {
			i = j - 1 // a lone run: literal backticks
			continue
		}
		content := strings.ReplaceAll(text[j:end], "\n", " ")
		if len(content) > 2 && content[0] == ' ' && content[len(content)-1] == ' ' && strings.TrimSpace(content) != "" {
			content = content[1 : len(content)-1]
		}
		// In a table, "\|" inside a span is a literal '|'.
		content = strings.ReplaceAll(content, `\|`, "|")
		out = append(out, span{text: content, line: first + strings.Count(text[:i], "\n"), start: i, end: end + n})
		i = end + n - 1
	}
	return out
}

// maskSpans returns text with every code span's bytes replaced by spaces
// (newlines kept), so that what is inside a span is never read as a link.
func maskSpans(text string, spans []span) string {
	b := []byte(text)
	for _, s := range spans {
		for i := s.start; i < s.end; i++ {
			if b[i] != '\n' {
				b[i] = ' '
			}
		}
	}
	return string(b)
}

// link is a link target found in a unit.
type link struct {
	target string
	line   int
}

var (
	inlineLink = regexp.MustCompile(`\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:"[^"]*"|'[^']*'|\([^)]*\)))?\s*\)`)
	refDef     = regexp.MustCompile(`(?m)^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)`)
	htmlLink   = regexp.MustCompile(`(?i)\b(?:href|src)\s*=\s*"([^"]*)"`)
	htmlAnchor = regexp.MustCompile(`(?i)<a\s[^>]*\b(?:name|id)\s*=\s*"([^"]*)"`)
)

// links returns the link targets of a unit: inline links and images,
// reference definitions and HTML href/src attributes, never what is inside
// a code span.
func (u unit) links() []link {
	text := maskSpans(u.text, codeSpans(u.text, u.line))
	var out []link
	add := func(target string, at int) {
		target = strings.TrimSuffix(strings.TrimPrefix(target, "<"), ">")
		out = append(out, link{target: target, line: u.line + strings.Count(text[:at], "\n")})
	}
	for _, m := range inlineLink.FindAllStringSubmatchIndex(text, -1) {
		add(text[m[2]:m[3]], m[0])
	}
	for _, m := range htmlLink.FindAllStringSubmatchIndex(text, -1) {
		add(text[m[2]:m[3]], m[0])
	}
	if u.heading == 0 && u.table == nil {
		for _, m := range refDef.FindAllStringSubmatchIndex(text, -1) {
			add(text[m[2]:m[3]], m[0])
		}
	}
	return out
}

// anchors returns the anchors of the file's headings by GitHub's rules
// (see slug), duplicates numbered -1, -2, ..., and the names of explicit
// HTML anchors (<a name="x"> or <a id="x">).
func (f *mdFile) anchors() map[string]bool {
	out := map[string]bool{}
	occurrences := map[string]int{} // github-slugger's bookkeeping
	for _, u := range f.units {
		for _, m := range htmlAnchor.FindAllStringSubmatch(u.text, -1) {
			out[m[1]] = true
		}
		if u.heading == 0 {
			continue
		}
		base := slug(headingText(u.text))
		s := base
		for {
			if _, taken := occurrences[s]; !taken {
				break
			}
			occurrences[base]++
			s = base + "-" + strconv.Itoa(occurrences[base])
		}
		occurrences[s] = 0
		out[s] = true
	}
	return out
}

var (
	mdLinkText = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	mdRefLink  = regexp.MustCompile(`!?\[([^\]]*)\]\[[^\]]*\]`)
	htmlTag    = regexp.MustCompile(`</?[A-Za-z][^>]*>`)
	emphasis   = regexp.MustCompile(`(^|[^\pL\pN_])_+|_+($|[^\pL\pN_])`)
)

// headingText is the text GitHub renders for a heading's Markdown: code
// spans' content as written, a link's text, no emphasis markers or HTML
// tags.
func headingText(md string) string {
	spans := codeSpans(md, 0)
	var b strings.Builder
	prev := 0
	plain := func(s string) string {
		s = mdLinkText.ReplaceAllString(s, "$1")
		s = mdRefLink.ReplaceAllString(s, "$1")
		s = htmlTag.ReplaceAllString(s, "")
		s = emphasis.ReplaceAllString(s, "$1$2")
		s = strings.NewReplacer(`\`, "", "*", "", "~", "").Replace(s)
		return s
	}
	for _, s := range spans {
		b.WriteString(plain(md[prev:s.start]))
		b.WriteString(s.text)
		prev = s.end
	}
	b.WriteString(plain(md[prev:]))
	return strings.TrimSpace(b.String())
}

// slug is GitHub's anchor for a heading's rendered text: lower case,
// letters, digits, '-' and '_' kept, each space a '-', everything else
// dropped.
func slug(text string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsNumber(r) || unicode.IsMark(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}
