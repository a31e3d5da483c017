package readme

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
)

// failure is one thing a document says that is not so.
type failure struct {
	file string // repository-relative
	line int
	kind string // "go block", "link", "metric", "flag", "header", "problem type", "identifier", "path", "make target"
	name string // what the document wrote, as the known-failures list names it
	msg  string
}

func (f failure) String() string {
	return fmt.Sprintf("%s:%d: %s %s: %s", f.file, f.line, f.kind, f.name, f.msg)
}

// key is how knownFailures names a failure: "file: name".
func (f failure) key() string { return f.file + ": " + f.name }

// ---- 1. Go blocks ----

// checkGoBlocks checks that every ```go block of f is a run of lines of
// an Example's body (bodies: name -> lines), so that go test compiles and
// runs it. A block after a not-compiled marker is counted, not checked.
func checkGoBlocks(f *mdFile, bodies map[string][]string) (fails []failure, checked, marked int) {
	for _, fc := range f.fences {
		if !fc.isGo() {
			continue
		}
		if fc.marked {
			marked++
			if fc.reason == "" {
				fails = append(fails, failure{f.path, fc.line, "go block", goBlockName(fc.body),
					"the not-compiled marker gives no reason: write <!-- not-compiled: why -->"})
			}
			continue
		}
		checked++
		s := dropImports(fc.body)
		found := false
		for _, b := range bodies {
			if contains(b, s) {
				found = true
				break
			}
		}
		if !found {
			fails = append(fails, failure{f.path, fc.line, "go block", goBlockName(fc.body),
				"not a run of lines of any Example's body, so go test does not compile it; make it one, " +
					"or mark a deliberate fragment with <!-- not-compiled: reason --> on the line before the fence"})
		}
	}
	return fails, checked, marked
}

// examplesIn returns the bodies of the Example functions of a test file,
// one level of indentation removed, as lines.
func examplesIn(path string, src []byte) map[string][]string {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, src, parser.SkipObjectResolution)
	if err != nil {
		return nil // not Go that parses: no Example in it
	}
	out := map[string][]string{}
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
		out[fn.Name.Name] = lines
	}
	return out
}

// isGo reports whether a fence holds Go: ```go (or ```golang).
func (fc fence) isGo() bool {
	return !fc.indented && (fc.info == "go" || fc.info == "golang")
}

// goBlockName names a Go block by its first line of code.
func goBlockName(body []string) string {
	for _, l := range dropImports(body) {
		if t := strings.TrimSpace(l); t != "" {
			return "go block `" + t + "`"
		}
	}
	return "empty go block"
}

// dropImports drops the import block a snippet may open with (imports are
// not in a body).
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

// ---- 2. Links ----

var urlScheme = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)

// linkChecker checks relative links against the files under root, reading
// each linked Markdown file's anchors once.
type linkChecker struct {
	root    string
	anchors map[string]map[string]bool
}

func newLinkChecker(root string) *linkChecker {
	return &linkChecker{root: root, anchors: map[string]map[string]bool{}}
}

// check returns f's relative links that do not resolve: a file that does
// not exist, or an anchor that is not a heading of the Markdown file it
// points into. Links with a scheme (http:, https:, mailto:) are not
// followed.
func (lc *linkChecker) check(f *mdFile) []failure {
	var fails []failure
	for _, u := range f.units {
		for _, l := range u.links() {
			if msg := lc.resolve(f, l.target); msg != "" {
				fails = append(fails, failure{f.path, l.line, "link", l.target, msg})
			}
		}
	}
	return fails
}

func (lc *linkChecker) resolve(f *mdFile, target string) string {
	if target == "" || urlScheme.MatchString(target) || strings.HasPrefix(target, "//") {
		return ""
	}
	p, frag, _ := strings.Cut(target, "#")
	if q := strings.IndexByte(p, '?'); q >= 0 {
		p = p[:q]
	}
	p, err := url.PathUnescape(p)
	if err != nil {
		return "malformed path: " + err.Error()
	}
	rel := f.path
	if p != "" {
		if strings.HasPrefix(p, "/") {
			rel = path.Clean(strings.TrimPrefix(p, "/"))
		} else {
			rel = path.Join(path.Dir(f.path), p)
		}
		if rel == ".." || strings.HasPrefix(rel, "../") {
			return "points outside the repository"
		}
		if _, err := os.Stat(filepath.Join(lc.root, filepath.FromSlash(rel))); err != nil {
			return fmt.Sprintf("%s does not exist", rel)
		}
	}
	if frag == "" || !strings.HasSuffix(strings.ToLower(rel), ".md") {
		return ""
	}
	if frag, err = url.PathUnescape(frag); err != nil {
		return "malformed anchor: " + err.Error()
	}
	a, ok := lc.anchors[rel]
	if !ok {
		g, err := readMarkdown(lc.root, rel)
		if err != nil {
			return err.Error()
		}
		a = g.anchors()
		lc.anchors[rel] = a
	}
	if !a[frag] {
		return fmt.Sprintf("%s has no heading whose anchor is #%s", rel, frag)
	}
	return ""
}

// ---- 3. Names ----

// headerAllowed are header names (lower case) the documents mention that
// the code never writes as a string: standard headers justonce leaves
// alone, and examples of names a user configures. Each says why.
var headerAllowed = map[string]string{
	"x-idempotency-replay": "an example of the name a user may give httpbridge.Config.LegacyReplayHeader; the bridge has no default",
}

var (
	headerSpan   = regexp.MustCompile(`^([A-Z][A-Za-z0-9]*(?:-[A-Z][A-Za-z0-9]*)+)(?::\s.*)?$`)
	headerFamily = regexp.MustCompile(`^([A-Z][A-Za-z0-9]*(?:-[A-Z][A-Za-z0-9]*)*)-\*$`)
	problemSlug  = regexp.MustCompile(`^[a-z]+(?:-[a-z]+)+$`)
	statusBefore = regexp.MustCompile("(?:^|[^\\w`])`?[1-5][0-9][0-9]`?$")
	problemWords = regexp.MustCompile(`(?i)problem[ -]types?\b`)
	flagToken    = regexp.MustCompile(`(?:^|[\s\[(|])--([a-z][a-z0-9-]*)`)
	cliCommand   = regexp.MustCompile(`(?:^|[\s;|&(])(?:justonce\s+[a-z-]|go run \./cmd/justonce)`)
	chainText    = regexp.MustCompile(`(?:^|[^\w.])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`)
	quoted       = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'[^']*'`)
	exported     = regexp.MustCompile(`^[A-Z]\w*$`)
	repoPath     = regexp.MustCompile(`^(?:\./)?([\w.-]+(?:/[\w.-]+)+/?|[\w.-]+/)$`)
	modImport    = regexp.MustCompile(`(?:^|[\s"])(github\.com/[\w.-]+/[\w.-]+(?:/[\w.-]+)*)`)
	goCommand    = regexp.MustCompile(`(?:^\s*(?:\$\s+)?|&&\s*|;\s*)go\s+(?:build|doc|generate|install|list|run|test|vet)\s(.*)`)
	dotPath      = regexp.MustCompile(`(?:^|\s)(\./[^\s'"]*)`)
	makeCommand  = regexp.MustCompile(`(?:^\s*(?:\$\s+)?|&&\s*|;\s*)make\s+([a-z][\w-]*)`)
)

// unqualifiedAllowed are Type.Member references the documents make to the
// standard library, whose type names the repository's packages also use.
var unqualifiedAllowed = map[string]string{
	"Request.GetBody": "net/http's http.Request.GetBody",
}

// checkNames checks the names f puts in code spans (and the CLI lines and
// problem URIs of its non-Go code blocks) against the code. checked counts
// the names looked up, by kind; allowed the entries of headerAllowed and
// unqualifiedAllowed that let a name pass.
func checkNames(f *mdFile, x *codeIndex) (fails []failure, checked map[string]int, allowed map[string]bool) {
	c := &nameChecker{f: f, x: x, home: filePackages(f, x), checked: map[string]int{}, allowed: map[string]bool{}}
	for _, u := range f.units {
		c.unit(u)
	}
	for _, fc := range f.fences {
		if fc.isGo() {
			continue // compiled (or marked): go test checks its names
		}
		c.fence(fc)
	}
	sort.SliceStable(c.fails, func(i, j int) bool { return c.fails[i].line < c.fails[j].line })
	return c.fails, c.checked, c.allowed
}

type nameChecker struct {
	f       *mdFile
	x       *codeIndex
	home    []*pkgInfo      // the package whose README f is, if any
	seen    map[string]bool // failures reported: line, kind, name
	fails   []failure
	checked map[string]int
	allowed map[string]bool
}

func (c *nameChecker) fail(line int, kind, name, msg string) {
	k := fmt.Sprint(line, " ", kind, " ", name)
	if c.seen == nil {
		c.seen = map[string]bool{}
	}
	if c.seen[k] {
		return
	}
	c.seen[k] = true
	c.fails = append(c.fails, failure{c.f.path, line, kind, name, msg})
}

// filePackages is the package whose directory holds f (a package README).
func filePackages(f *mdFile, x *codeIndex) []*pkgInfo {
	dir := path.Dir(f.path)
	for _, ps := range x.byName {
		for _, p := range ps {
			if p.dir == dir {
				return []*pkgInfo{p}
			}
		}
	}
	return nil
}

// isCLISpan reports whether a span shows the justonce CLI: a command line
// or its package.
func isCLISpan(s string) bool {
	return strings.HasPrefix(s, "justonce ") || strings.Contains(s, "cmd/justonce")
}

func (c *nameChecker) unit(u unit) {
	spans := codeSpans(u.text, u.line)
	// The unit is about the CLI when it, or a heading above it, shows a
	// justonce command.
	cli := false
	for _, s := range spans {
		cli = cli || isCLISpan(s.text)
	}
	home := slices.Clone(c.home)
	for _, h := range u.headings {
		for _, s := range codeSpans(h, 0) {
			cli = cli || isCLISpan(s.text)
			home = append(home, c.spanPackages(s.text)...)
		}
	}
	masked := maskSpans(u.text, spans)
	oldNames := -1 // in a "was | now" table, the first cell names what no longer exists
	if u.table != nil && u.row > 0 && len(u.table.header) > 0 && strings.EqualFold(strings.TrimSpace(u.table.header[0]), "was") {
		oldNames = firstCellEnd(u.text)
	}
	for _, s := range spans {
		if s.start < oldNames {
			continue
		}
		c.metric(s)
		c.header(s)
		c.problem(u.text, masked, s)
		if strings.HasPrefix(s.text, "justonce ") || cli && strings.HasPrefix(s.text, "--") {
			c.flags(s.line, s.text)
		}
		c.identifiers(s, home)
		c.path(s)
		c.goCommand(s.line, s.text)
		if m := makeCommand.FindStringSubmatch(s.text); m != nil {
			c.makeTarget(s.line, m[1])
		}
	}
	if u.table != nil && u.row > 0 {
		c.configRow(u)
	}
}

// spanPackages are the packages a heading's span names: "inbox" or
// "inbox.Config" name inbox.
func (c *nameChecker) spanPackages(s string) []*pkgInfo {
	name, _, _ := strings.Cut(s, ".")
	return c.x.byName[name]
}

func (c *nameChecker) fence(fc fence) {
	for i := 0; i < len(fc.body); i++ {
		line, n := fc.body[i], fc.line+1+i
		if fc.indented {
			n = fc.line + i
		}
		for strings.HasSuffix(strings.TrimRight(line, " "), `\`) && i+1 < len(fc.body) {
			i++
			line = strings.TrimSuffix(strings.TrimRight(line, " "), `\`) + " " + fc.body[i]
		}
		if cliCommand.MatchString(line) {
			c.flags(n, line)
		}
		c.goCommand(n, line)
		if fc.info == "sh" || fc.info == "bash" || fc.info == "shell" || fc.info == "console" {
			for _, m := range makeCommand.FindAllStringSubmatch(line, -1) {
				c.makeTarget(n, m[1])
			}
		}
		if c.x.problemBase != "" {
			for rest := line; ; {
				at := strings.Index(rest, c.x.problemBase)
				if at < 0 {
					break
				}
				rest = rest[at+len(c.x.problemBase):]
				slug := rest
				if end := strings.IndexFunc(rest, func(r rune) bool { return !(r == '-' || r >= 'a' && r <= 'z') }); end >= 0 {
					slug = rest[:end]
				}
				if slug != "" {
					c.checked["problem type"]++
					if !c.x.problems[slug] {
						c.fail(n, "problem type", slug, c.problemMsg())
					}
				}
			}
		}
	}
}

func (c *nameChecker) metric(s span) {
	for _, w := range justonceWord.FindAllString(s.text, -1) {
		c.checked["metric"]++
		if !c.x.metrics[w] && !c.x.words[w] {
			c.fail(s.line, "metric", w, "no metric of that name is registered (metrics/ defines the justonce_ metrics), "+
				"nor is it a table or other name the code uses")
		}
	}
}

func (c *nameChecker) header(s span) {
	name := ""
	prefix := false
	if m := headerSpan.FindStringSubmatch(s.text); m != nil {
		name = m[1]
	} else if m := headerFamily.FindStringSubmatch(s.text); m != nil {
		name, prefix = m[1], true
	}
	if name == "" {
		return
	}
	c.checked["header"]++
	low := strings.ToLower(name)
	if _, ok := headerAllowed[low]; ok {
		c.allowed[low] = true
		return
	}
	if prefix {
		for l := range c.x.literals {
			if strings.HasPrefix(l, low+"-") {
				return
			}
		}
		c.fail(s.line, "header", name+"-*", "no header name of the code starts with "+name+"-")
		return
	}
	if !c.x.literals[low] {
		c.fail(s.line, "header", name, "the code never names this header (no string literal is "+name+
			"); if it is a standard header justonce leaves alone, add it to headerAllowed")
	}
}

func (c *nameChecker) problemMsg() string {
	var known []string
	for p := range c.x.problems {
		known = append(known, p)
	}
	sort.Strings(known)
	return "not one of the HTTP bridge's problem types (" + strings.Join(known, ", ") + ")"
}

// problem checks a span that names a problem type: a slug right after an
// HTTP status ("409 `request-in-progress`"), or after the words "problem
// type" in the same sentence; or the type's full URI. text is the span's
// unit, masked the same with its code spans blanked.
func (c *nameChecker) problem(text, masked string, s span) {
	if c.x.problemBase != "" {
		if slug, ok := strings.CutPrefix(s.text, c.x.problemBase); ok {
			if slug != "" {
				c.checked["problem type"]++
				if !c.x.problems[slug] {
					c.fail(s.line, "problem type", slug, c.problemMsg())
				}
			}
			return
		}
	}
	if !problemSlug.MatchString(s.text) {
		return
	}
	before := strings.TrimRight(text[:s.start], " \t\n")
	if statusBefore.MatchString(before) || afterProblemWords(masked[:s.start]) {
		c.checked["problem type"]++
		if !c.x.problems[s.text] {
			c.fail(s.line, "problem type", s.text, c.problemMsg())
		}
	}
}

// path checks a span that is a path of the repository (harness/testsvc,
// inbox/pgstore.go, bench/peers): one whose first element exists at the
// root (or beside the document), so that a word with a slash (ops/s) is
// left alone; and the directory of an import path of one of the
// repository's modules.
func (c *nameChecker) path(s span) {
	if m := modImport.FindAllStringSubmatch(s.text, -1); m != nil {
		for _, ip := range m {
			c.importPath(s.line, ip[1])
		}
		return
	}
	m := repoPath.FindStringSubmatch(s.text)
	if m == nil {
		return
	}
	p := strings.TrimSuffix(m[1], "/")
	first, _, _ := strings.Cut(p, "/")
	for _, base := range []string{".", path.Dir(c.f.path)} {
		if !c.exists(path.Join(base, first)) {
			continue
		}
		c.checked["path"]++
		if !c.exists(path.Join(base, p)) {
			c.fail(s.line, "path", s.text, fmt.Sprintf("%s does not exist", path.Join(base, p)))
		}
		return
	}
}

// goCommand checks the package paths (./inbox, ./transports/natsinbox/...)
// of a go command line (go test, go run, go doc): run from the root, each
// must exist.
func (c *nameChecker) goCommand(line int, text string) {
	m := goCommand.FindStringSubmatch(text)
	if m == nil {
		return
	}
	for _, p := range dotPath.FindAllStringSubmatch(m[1], -1) {
		rel := path.Clean(strings.TrimSuffix(p[1], "/..."))
		c.checked["path"]++
		if !c.exists(rel) {
			c.fail(line, "path", p[1], fmt.Sprintf("%s does not exist (go commands in the documents run from the repository's root)", rel))
		}
	}
}

// importPath checks that an import path under one of the repository's
// modules names a directory.
func (c *nameChecker) importPath(line int, ip string) {
	best := ""
	for mp := range c.x.modules {
		if (ip == mp || strings.HasPrefix(ip, mp+"/")) && len(mp) > len(best) {
			best = mp
		}
	}
	if best == "" {
		return // another module's
	}
	c.checked["path"]++
	dir := path.Join(c.x.modules[best], strings.TrimPrefix(strings.TrimPrefix(ip, best), "/"))
	if fi, err := os.Stat(filepath.Join(c.x.root, filepath.FromSlash(dir))); err != nil || !fi.IsDir() {
		c.fail(line, "path", ip, fmt.Sprintf("no package directory %s in the repository", dir))
	}
}

func (c *nameChecker) exists(rel string) bool {
	if rel == ".." || strings.HasPrefix(rel, "../") {
		return false
	}
	_, err := os.Stat(filepath.Join(c.x.root, filepath.FromSlash(rel)))
	return err == nil
}

func (c *nameChecker) makeTarget(line int, target string) {
	c.checked["make target"]++
	if !c.x.makeTargets[target] {
		c.fail(line, "make target", "make "+target, "the Makefile has no target "+target)
	}
}

// afterProblemWords reports whether the text before a span says "problem
// type(s)" in the same sentence: "the bridge's problem types (`key-reused`,
// `request-in-progress`, …)". before has its code spans masked.
func afterProblemWords(before string) bool {
	m := problemWords.FindAllStringIndex(before, -1)
	if m == nil {
		return false
	}
	return !strings.ContainsAny(before[m[len(m)-1][1]:], ".;!?")
}

func (c *nameChecker) flags(line int, text string) {
	for _, m := range flagToken.FindAllStringSubmatch(text, -1) {
		c.checked["flag"]++
		if !c.x.flags[m[1]] {
			c.fail(line, "flag", "--"+m[1], "the justonce CLI (cmd/justonce) defines no flag "+m[1])
		}
	}
}

// ref is a reference to the code found in a span: a chain of names
// (pkg.Type.Field, Type.Method, pkg.Func) and, for a composite literal,
// the fields it sets.
type ref struct {
	chain  []string
	fields []string
}

// spanRefs finds the references of a span: parsed as a Go expression when
// it is one, else the dotted names in its text.
func spanRefs(text string) []ref {
	src := strings.ReplaceAll(text, "…", "x")
	e, err := parser.ParseExpr(src)
	if err != nil {
		var out []ref
		for _, m := range chainText.FindAllStringSubmatch(quoted.ReplaceAllString(src, `""`), -1) {
			out = append(out, ref{chain: strings.Split(m[1], ".")})
		}
		return out
	}
	return exprRefs(e)
}

// exprRefs finds the references of a parsed expression: its outermost
// selector chains, and the type and set fields of its composite literals.
func exprRefs(root ast.Node) []ref {
	var out []ref
	ast.Inspect(root, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.SelectorExpr:
			if ch := flatten(n); ch != nil {
				out = append(out, ref{chain: ch})
				return false
			}
		case *ast.CompositeLit:
			ch := flatten(n.Type)
			if ch == nil && n.Type != nil {
				out = append(out, exprRefs(n.Type)...)
			}
			// Key{Scope, Tenant, ID}: a list of bare exported names is
			// the fields the text speaks of.
			bare := ch != nil && len(n.Elts) > 0
			for _, el := range n.Elts {
				if id, ok := el.(*ast.Ident); !ok || !exported.MatchString(id.Name) {
					bare = false
				}
			}
			r := ref{chain: ch}
			for _, el := range n.Elts {
				switch el := el.(type) {
				case *ast.KeyValueExpr:
					if id, ok := el.Key.(*ast.Ident); ok && ch != nil {
						r.fields = append(r.fields, id.Name)
					}
					out = append(out, exprRefs(el.Value)...)
				case *ast.Ident:
					if bare {
						r.fields = append(r.fields, el.Name)
					}
				default:
					out = append(out, exprRefs(el)...)
				}
			}
			if ch != nil {
				out = append(out, r)
			}
			return false
		}
		return true
	})
	return out
}

// flatten turns a.b.c into [a b c]; nil when the root is not a name.
func flatten(e ast.Expr) []string {
	switch e := e.(type) {
	case *ast.Ident:
		return []string{e.Name}
	case *ast.SelectorExpr:
		if x := flatten(e.X); x != nil {
			return append(x, e.Sel.Name)
		}
	}
	return nil
}

// identifiers checks the references of a span to the repository's
// packages. home are the packages the span's context is about (the
// package README, the packages its headings name): a Type.Member without a
// package is looked up there first, then in every package.
func (c *nameChecker) identifiers(s span, home []*pkgInfo) {
	for _, r := range spanRefs(s.text) {
		ch := r.chain
		if len(ch) == 0 {
			continue
		}
		for _, fld := range r.fields {
			c.reference(s.line, append(ch[:len(ch):len(ch)], fld), home, true)
		}
		c.reference(s.line, ch, home, false)
	}
}

// reference checks one chain of names. field says the last name is a
// field a composite literal sets.
func (c *nameChecker) reference(line int, ch []string, home []*pkgInfo, field bool) {
	name := strings.Join(ch, ".")
	if pkgs := c.x.byName[ch[0]]; len(pkgs) > 0 && len(ch) > 1 {
		if !exported.MatchString(ch[1]) {
			return // a file name (consumer.go) or a variable that shares a package's name
		}
		c.checked["identifier"]++
		if msg := c.qualified(pkgs, ch[1:]); msg != "" {
			c.fail(line, "identifier", name, msg)
		}
		return
	}
	for _, n := range ch {
		if !exported.MatchString(n) {
			return // a variable's selector (tx.Commit), a file name: not checked
		}
	}
	if _, ok := unqualifiedAllowed[name]; ok {
		c.allowed[name] = true
		return
	}
	if len(ch) < 2 {
		return
	}
	// The first name is a type (Ledger.Do) or a field (StoreBackoff.Max,
	// Processor.MaxAttempts: the field's type), of the context's packages
	// if they have one, else of any.
	cands := append(c.typesNamed(ch[0], home), c.fieldTypesNamed(ch[0], home)...)
	if len(home) == 0 || len(cands) == 0 {
		cands = append(c.typesNamed(ch[0], nil), c.fieldTypesNamed(ch[0], nil)...)
	}
	if len(cands) == 0 {
		return // neither: another library's, or a name the index cannot follow
	}
	cands = dedupe(cands)
	c.checked["identifier"]++
	var tried []string
	for _, t := range cands {
		msg := c.members(t, ch[1:])
		if msg == "" {
			return
		}
		tried = append(tried, t.pkg.name+"."+t.name)
	}
	sort.Strings(tried)
	what := "field or method"
	if field {
		what = "field"
	}
	c.fail(line, "identifier", name, fmt.Sprintf("no %s %s in %s", what, strings.Join(ch[1:], "."), strings.Join(tried, ", ")))
}

// dedupe drops the types seen before in ts.
func dedupe(ts []*typeInfo) []*typeInfo {
	var out []*typeInfo
	for _, t := range ts {
		if !slices.Contains(out, t) {
			out = append(out, t)
		}
	}
	return out
}

// typesNamed returns the types called name in pkgs, or in every package
// when pkgs is nil.
func (c *nameChecker) typesNamed(name string, pkgs []*pkgInfo) []*typeInfo {
	var out []*typeInfo
	seen := map[*typeInfo]bool{}
	add := func(p *pkgInfo) {
		if t := p.types[name]; t != nil && !seen[t] {
			seen[t] = true
			out = append(out, t)
		}
	}
	if pkgs == nil {
		for _, ps := range c.x.byName {
			for _, p := range ps {
				add(p)
			}
		}
	}
	for _, p := range pkgs {
		add(p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].pkg.path < out[j].pkg.path })
	return out
}

// fieldTypesNamed returns the types of the fields called name of the
// structs in pkgs, or in every package when pkgs is nil, where a field's
// type is a named type of the repository.
func (c *nameChecker) fieldTypesNamed(name string, pkgs []*pkgInfo) []*typeInfo {
	if pkgs == nil {
		for _, ps := range c.x.byName {
			pkgs = append(pkgs, ps...)
		}
	}
	var out []*typeInfo
	seen := map[*typeInfo]bool{}
	for _, p := range pkgs {
		for _, t := range p.types {
			if _, ok := t.fields[name]; !ok {
				continue
			}
			if ft := c.x.fieldType(t, name); ft != nil && !seen[ft] {
				seen[ft] = true
				out = append(out, ft)
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].pkg.path+"."+out[i].name < out[j].pkg.path+"."+out[j].name })
	return out
}

// qualified checks pkg.Name[.Member...] against the packages of that name;
// it returns "" when one of them has it.
func (c *nameChecker) qualified(pkgs []*pkgInfo, rest []string) string {
	var msg string
	for _, p := range pkgs {
		if t := p.types[rest[0]]; t != nil {
			if msg = c.members(t, rest[1:]); msg == "" {
				return ""
			}
			continue
		}
		if p.values[rest[0]] {
			return "" // a func, const or var; what follows it is not checked
		}
		msg = fmt.Sprintf("package %s (%s) has no exported %s", p.name, p.dir, rest[0])
	}
	return msg
}

// members walks names down from t: each a field or method of the type
// before it. It stops, content, at a method, a type outside the repository
// or a field whose type is not a named type.
func (c *nameChecker) members(t *typeInfo, names []string) string {
	for i, n := range names {
		found, opaque := c.x.member(t, n)
		if opaque && !found {
			return ""
		}
		if !found {
			return fmt.Sprintf("%s.%s has no field or method %s", t.pkg.name, t.name, n)
		}
		if i+1 < len(names) {
			if t = c.x.fieldType(t, n); t == nil {
				return ""
			}
		}
	}
	return ""
}

// configRow checks the first cell of a configuration table's row: a table
// whose header's first cell names the type (`kafkainbox.Config` /
// `franzinbox.Config`), or is "field" under a heading that names it. Every
// bare name in the cell must be a field (or method) of each type named.
func (c *nameChecker) configRow(u unit) {
	types := c.tableTypes(u)
	if len(types) == 0 {
		return
	}
	cells := splitRow(u.text)
	if len(cells) == 0 {
		return
	}
	for _, s := range codeSpans(cells[0], u.line) {
		if !exported.MatchString(s.text) {
			continue
		}
		for _, t := range types {
			c.checked["identifier"]++
			if found, opaque := c.x.member(t, s.text); !found && !opaque {
				c.fail(u.line, "identifier", t.pkg.name+"."+t.name+"."+s.text,
					fmt.Sprintf("the table of %s.%s lists %s, which is not one of its fields", t.pkg.name, t.name, s.text))
			}
		}
	}
}

func (c *nameChecker) tableTypes(u unit) []*typeInfo {
	typesIn := func(md string) []*typeInfo {
		var out []*typeInfo
		for _, s := range codeSpans(md, 0) {
			ch := strings.Split(s.text, ".")
			if len(ch) != 2 {
				continue
			}
			for _, p := range c.x.byName[ch[0]] {
				if t := p.types[ch[1]]; t != nil {
					out = append(out, t)
				}
			}
		}
		return out
	}
	if len(u.table.header) == 0 {
		return nil
	}
	if ts := typesIn(u.table.header[0]); len(ts) > 0 {
		return ts
	}
	if strings.EqualFold(strings.TrimSpace(u.table.header[0]), "field") && len(u.headings) > 0 {
		return typesIn(u.headings[len(u.headings)-1])
	}
	return nil
}

// firstCellEnd is the byte offset in a table row's text of the pipe that
// ends its first cell (pipes inside code spans and escaped ones do not
// count), or -1.
func firstCellEnd(row string) int {
	start := strings.Index(row, "|")
	if start < 0 {
		return -1
	}
	inCode := false
	for i := start + 1; i < len(row); i++ {
		switch row[i] {
		case '`':
			inCode = !inCode
		case '\\':
			i++
		case '|':
			if !inCode {
				return i
			}
		}
	}
	return -1
}
