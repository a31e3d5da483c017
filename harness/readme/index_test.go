package readme

import (
	"bufio"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// This file indexes what the documentation may name, from the source with
// go/parser alone: every package's exported API, the metric names the code
// registers, the CLI's flags, the HTTP bridge's problem types and the
// string literals of the code (where header names live).

// codeIndex is what the code defines.
type codeIndex struct {
	byName   map[string][]*pkgInfo // package name -> packages (main packages left out)
	byPath   map[string]*pkgInfo   // import path -> package
	metrics  map[string]bool       // metric names the code registers
	words    map[string]bool       // justonce_... words in string literals and SQL files (tables, functions)
	literals map[string]bool       // every string literal of the non-test code, lower-cased
	flags    map[string]bool       // the justonce CLI's flags, without dashes
	problems map[string]bool       // the HTTP bridge's problem type slugs
	// problemBase is the URI prefix of the problem types, e.g.
	// "https://justonce.dev/problems/".
	problemBase string
	root        string            // the repository's root
	modules     map[string]string // module path -> its directory (slash, relative)
	makeTargets map[string]bool   // the root Makefile's targets
}

// pkgInfo is one package's exported API.
type pkgInfo struct {
	name, dir, path string
	types           map[string]*typeInfo
	values          map[string]bool // funcs, consts, vars, and the Example functions of its tests
}

// typeInfo is a named type: its fields (with promoted ones reached through
// embeds), its methods, or the type it is defined from.
type typeInfo struct {
	pkg     *pkgInfo
	name    string
	imports map[string]string   // the declaring file's imports: name -> path
	fields  map[string]ast.Expr // field name -> its type (an embedded field under its type's name)
	methods map[string]bool
	embeds  []ast.Expr // embedded types (struct fields and interface elements)
	under   ast.Expr   // for "type T U" and "type T = U": U
}

// Where the index looks for the CLI's flags and the problem types.
const (
	cliDir    = "cmd/justonce"
	bridgeDir = "httpbridge"
	metricPkg = "metrics"
)

var (
	justonceWord = regexp.MustCompile(`\bjustonce_[a-z0-9_]+\b`)
	metricName   = regexp.MustCompile(`^justonce_[a-z0-9_]+$`)
	problemURL   = regexp.MustCompile(`^https?://\S*/problems/$`)
)

// skipDir reports whether a walk leaves the directory out: VCS data,
// fixtures and hidden directories.
func skipDir(name string) bool {
	return name == "testdata" || name == "node_modules" || name == "vendor" || strings.HasPrefix(name, ".") && name != "."
}

// walkRepo calls fn with the path and the slash-separated
// repository-relative name of every file under root, leaving out what
// skipDir names.
func walkRepo(root string, fn func(p, rel string) error) error {
	return filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if p != root && skipDir(d.Name()) {
				return filepath.SkipDir
			}
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		return fn(p, filepath.ToSlash(rel))
	})
}

// buildIndex indexes the Go code under root.
func buildIndex(root string) (*codeIndex, error) {
	x := &codeIndex{
		byName: map[string][]*pkgInfo{}, byPath: map[string]*pkgInfo{},
		metrics: map[string]bool{}, words: map[string]bool{}, literals: map[string]bool{},
		flags: map[string]bool{"h": true, "help": true}, problems: map[string]bool{},
		root: root, modules: map[string]string{}, makeTargets: map[string]bool{},
	}
	modules := map[string]string{} // module directory (slash, relative) -> module path
	dirs := map[string][]string{}  // directory (slash, relative) -> its .go files
	err := walkRepo(root, func(p, rel string) error {
		switch base := path.Base(rel); {
		case base == "go.mod":
			mp, err := modulePath(p)
			if err != nil {
				return err
			}
			modules[path.Dir(rel)] = mp
		case strings.HasSuffix(rel, ".go"):
			dirs[path.Dir(rel)] = append(dirs[path.Dir(rel)], rel)
		case strings.HasSuffix(rel, ".sql"):
			src, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			for _, w := range justonceWord.FindAllString(string(src), -1) {
				x.words[w] = true
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var pending []methodDecl
	for dir, files := range dirs {
		if err := x.indexDir(root, dir, files, modules, &pending); err != nil {
			return nil, err
		}
	}
	for _, m := range pending {
		if t := m.pkg.types[m.recv]; t != nil {
			t.methods[m.name] = true
		}
	}
	for dir, mp := range modules {
		x.modules[mp] = dir
	}
	if err := x.indexMakefile(filepath.Join(root, "Makefile")); err != nil {
		return nil, err
	}
	return x, nil
}

// methodDecl is a method seen before its type may have been.
type methodDecl struct {
	pkg        *pkgInfo
	recv, name string
}

var makeRule = regexp.MustCompile(`^([A-Za-z0-9_.%-]+(?:\s+[A-Za-z0-9_.%-]+)*)\s*:(?:[^=]|$)`)

// indexMakefile records the Makefile's targets (none when there is none).
func (x *codeIndex) indexMakefile(name string) error {
	f, err := os.Open(name)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if m := makeRule.FindStringSubmatch(s.Text()); m != nil {
			for _, t := range strings.Fields(m[1]) {
				if !strings.HasPrefix(t, ".") {
					x.makeTargets[t] = true
				}
			}
		}
	}
	return s.Err()
}

// modulePath reads the module line of a go.mod.
func modulePath(gomod string) (string, error) {
	f, err := os.Open(gomod)
	if err != nil {
		return "", err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(s.Text()), "module "); ok {
			return strings.Trim(strings.TrimSpace(rest), `"`), nil
		}
	}
	return "", s.Err()
}

// importPath is the import path of the package in dir, from the go.mod
// nearest above it.
func importPath(dir string, modules map[string]string) string {
	for d := dir; ; d = path.Dir(d) {
		if mp, ok := modules[d]; ok {
			if d == dir {
				return mp
			}
			if d == "." {
				return mp + "/" + dir
			}
			return mp + "/" + strings.TrimPrefix(dir, d+"/")
		}
		if d == "." || d == "/" {
			return dir
		}
	}
}

func (x *codeIndex) indexDir(root, dir string, files []string, modules map[string]string, pending *[]methodDecl) error {
	sort.Strings(files)
	p := &pkgInfo{dir: dir, path: importPath(dir, modules), types: map[string]*typeInfo{}, values: map[string]bool{}}
	var examples []string
	var cliFiles, bridgeFiles []*ast.File
	for _, rel := range files {
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, filepath.Join(root, filepath.FromSlash(rel)), nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if strings.HasSuffix(rel, "_test.go") {
			for _, d := range f.Decls {
				if fn, ok := d.(*ast.FuncDecl); ok && fn.Recv == nil && strings.HasPrefix(fn.Name.Name, "Example") {
					examples = append(examples, fn.Name.Name)
				}
			}
			continue
		}
		if p.name == "" || p.name == "main" {
			p.name = f.Name.Name // a library's files win over a tool's main beside them
		}
		x.indexLiterals(f, dir == metricPkg)
		if dir == cliDir {
			cliFiles = append(cliFiles, f)
		}
		if dir == bridgeDir {
			bridgeFiles = append(bridgeFiles, f)
		}
		if f.Name.Name == "main" {
			continue
		}
		imports := fileImports(f)
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil {
					p.values[d.Name.Name] = true
				} else if recv := recvName(d.Recv.List[0].Type); recv != "" {
					*pending = append(*pending, methodDecl{pkg: p, recv: recv, name: d.Name.Name})
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						p.types[s.Name.Name] = newType(p, s, imports)
					case *ast.ValueSpec:
						for _, n := range s.Names {
							p.values[n.Name] = true
						}
					}
				}
			}
		}
	}
	if len(cliFiles) > 0 {
		x.indexFlags(cliFiles)
	}
	if len(bridgeFiles) > 0 {
		x.indexProblems(bridgeFiles)
	}
	if p.name == "" || p.name == "main" {
		return nil
	}
	for _, e := range examples {
		p.values[e] = true
	}
	x.byName[p.name] = append(x.byName[p.name], p)
	x.byPath[p.path] = p
	return nil
}

func fileImports(f *ast.File) map[string]string {
	out := map[string]string{}
	for _, s := range f.Imports {
		p, err := strconv.Unquote(s.Path.Value)
		if err != nil {
			continue
		}
		name := path.Base(p)
		if s.Name != nil {
			name = s.Name.Name
		}
		out[name] = p
	}
	return out
}

// baseType strips what decorates a named type in a declaration: *T,
// T[P], (T).
func baseType(e ast.Expr) ast.Expr {
	for {
		switch t := e.(type) {
		case *ast.StarExpr:
			e = t.X
		case *ast.IndexExpr:
			e = t.X
		case *ast.IndexListExpr:
			e = t.X
		case *ast.ParenExpr:
			e = t.X
		default:
			return e
		}
	}
}

// recvName is the type name of a method's receiver: T for T, *T, T[P].
func recvName(e ast.Expr) string {
	if id, ok := baseType(e).(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

func newType(p *pkgInfo, s *ast.TypeSpec, imports map[string]string) *typeInfo {
	t := &typeInfo{pkg: p, name: s.Name.Name, imports: imports, fields: map[string]ast.Expr{}, methods: map[string]bool{}}
	switch u := s.Type.(type) {
	case *ast.StructType:
		for _, f := range u.Fields.List {
			if len(f.Names) == 0 {
				t.embeds = append(t.embeds, f.Type)
				if n := embeddedName(f.Type); n != "" {
					t.fields[n] = f.Type
				}
				continue
			}
			for _, n := range f.Names {
				t.fields[n.Name] = f.Type
			}
		}
	case *ast.InterfaceType:
		for _, m := range u.Methods.List {
			if len(m.Names) == 0 {
				t.embeds = append(t.embeds, m.Type)
				continue
			}
			for _, n := range m.Names {
				t.methods[n.Name] = true
			}
		}
	default:
		t.under = s.Type
	}
	return t
}

// embeddedName is the name of an embedded field: T for T, *T, pkg.T.
func embeddedName(e ast.Expr) string {
	switch t := baseType(e).(type) {
	case *ast.Ident:
		return t.Name
	case *ast.SelectorExpr:
		return t.Sel.Name
	}
	return ""
}

// indexLiterals records the file's string literals, the justonce_ words in
// them and the metric names it registers: prometheus options' Name (joined
// with Namespace and Subsystem), NewDesc's first argument, and, in the
// metrics package, any literal that is a whole justonce_ name.
func (x *codeIndex) indexLiterals(f *ast.File, metricsPkg bool) {
	lit := func(e ast.Expr) (string, bool) {
		b, ok := e.(*ast.BasicLit)
		if !ok || b.Kind != token.STRING {
			return "", false
		}
		s, err := strconv.Unquote(b.Value)
		return s, err == nil
	}
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.BasicLit:
			if s, ok := lit(n); ok {
				x.literals[strings.ToLower(s)] = true
				for _, w := range justonceWord.FindAllString(s, -1) {
					x.words[w] = true
				}
				if metricsPkg && metricName.MatchString(s) {
					x.metrics[s] = true
				}
			}
		case *ast.CompositeLit:
			parts := map[string]string{}
			for _, e := range n.Elts {
				if kv, ok := e.(*ast.KeyValueExpr); ok {
					if k, ok := kv.Key.(*ast.Ident); ok {
						if s, ok := lit(kv.Value); ok {
							parts[k.Name] = s
						}
					}
				}
			}
			if parts["Name"] != "" {
				var name []string
				for _, k := range []string{"Namespace", "Subsystem", "Name"} {
					if parts[k] != "" {
						name = append(name, parts[k])
					}
				}
				if full := strings.Join(name, "_"); metricName.MatchString(full) {
					x.metrics[full] = true
				}
			}
		case *ast.CallExpr:
			if sel, ok := n.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "NewDesc" && len(n.Args) > 0 {
				if s, ok := lit(n.Args[0]); ok && metricName.MatchString(s) {
					x.metrics[s] = true
				}
			}
		}
		return true
	})
}

// flagDefiners are the flag.FlagSet methods that define a flag.
var flagDefiners = []string{
	"Bool", "BoolVar", "BoolFunc", "Duration", "DurationVar", "Float64", "Float64Var", "Func",
	"Int", "IntVar", "Int64", "Int64Var", "String", "StringVar", "TextVar",
	"Uint", "UintVar", "Uint64", "Uint64Var", "Var",
}

// indexFlags records the CLI's flags: the first string literal argument of
// every call that defines a flag. A call defines one when it calls a
// flag.FlagSet method that does, or a function of the CLI's own that passes
// one of its string parameters on to such a call (as a helper that takes
// the flag's name does).
func (x *codeIndex) indexFlags(files []*ast.File) {
	definers := map[string]bool{}
	for _, d := range flagDefiners {
		definers[d] = true
	}
	callName := func(c *ast.CallExpr) string {
		switch f := c.Fun.(type) {
		case *ast.SelectorExpr:
			return f.Sel.Name
		case *ast.Ident:
			return f.Name
		}
		return ""
	}
	for changed := true; changed; {
		changed = false
		for _, f := range files {
			for _, d := range f.Decls {
				fn, ok := d.(*ast.FuncDecl)
				if !ok || definers[fn.Name.Name] || fn.Body == nil {
					continue
				}
				params := map[string]bool{}
				for _, fld := range fn.Type.Params.List {
					if id, ok := fld.Type.(*ast.Ident); ok && id.Name == "string" {
						for _, n := range fld.Names {
							params[n.Name] = true
						}
					}
				}
				ast.Inspect(fn.Body, func(n ast.Node) bool {
					c, ok := n.(*ast.CallExpr)
					if !ok || !definers[callName(c)] {
						return true
					}
					for _, a := range c.Args {
						if id, ok := a.(*ast.Ident); ok && params[id.Name] {
							definers[fn.Name.Name], changed = true, true
						}
					}
					return true
				})
			}
		}
	}
	for _, f := range files {
		ast.Inspect(f, func(n ast.Node) bool {
			c, ok := n.(*ast.CallExpr)
			if !ok || !definers[callName(c)] {
				return true
			}
			for _, a := range c.Args {
				if b, ok := a.(*ast.BasicLit); ok && b.Kind == token.STRING {
					if s, err := strconv.Unquote(b.Value); err == nil {
						x.flags[s] = true
					}
					break
				}
			}
			return true
		})
	}
}

// indexProblems records the bridge's problem types: its string constants
// that start with a constant ending in "/problems/".
func (x *codeIndex) indexProblems(files []*ast.File) {
	values := map[string]string{}
	var eval func(e ast.Expr) (string, bool)
	eval = func(e ast.Expr) (string, bool) {
		switch e := e.(type) {
		case *ast.BasicLit:
			if e.Kind != token.STRING {
				return "", false
			}
			s, err := strconv.Unquote(e.Value)
			return s, err == nil
		case *ast.Ident:
			s, ok := values[e.Name]
			return s, ok
		case *ast.ParenExpr:
			return eval(e.X)
		case *ast.BinaryExpr:
			if e.Op != token.ADD {
				return "", false
			}
			a, ok1 := eval(e.X)
			b, ok2 := eval(e.Y)
			return a + b, ok1 && ok2
		}
		return "", false
	}
	// Constants may refer to ones declared later: evaluate until nothing
	// new is learnt.
	for changed := true; changed; {
		changed = false
		for _, f := range files {
			for _, d := range f.Decls {
				g, ok := d.(*ast.GenDecl)
				if !ok || g.Tok != token.CONST {
					continue
				}
				for _, s := range g.Specs {
					vs := s.(*ast.ValueSpec)
					for i, n := range vs.Names {
						if i >= len(vs.Values) {
							continue
						}
						if _, done := values[n.Name]; done {
							continue
						}
						if v, ok := eval(vs.Values[i]); ok {
							values[n.Name], changed = v, true
						}
					}
				}
			}
		}
	}
	for _, v := range values {
		if problemURL.MatchString(v) {
			x.problemBase = v
		}
	}
	if x.problemBase == "" {
		return
	}
	for _, v := range values {
		if slug, ok := strings.CutPrefix(v, x.problemBase); ok && slug != "" {
			x.problems[slug] = true
		}
	}
}

// resolve finds the named type an expression of a type's declaration
// names: T, *T, pkg.T, T[P]. external is true when it names a type outside
// the repository (or one the index cannot see), whose members are unknown.
func (x *codeIndex) resolve(from *typeInfo, e ast.Expr) (t *typeInfo, external bool) {
	switch s := baseType(e).(type) {
	case *ast.Ident:
		// Not one of the package's types: a predeclared one (string,
		// error, any), whose members no document names.
		return from.pkg.types[s.Name], false
	case *ast.SelectorExpr:
		id, ok := s.X.(*ast.Ident)
		if !ok {
			return nil, true
		}
		p := x.byPath[from.imports[id.Name]]
		if p == nil || p.types[s.Sel.Name] == nil {
			return nil, true
		}
		return p.types[s.Sel.Name], false
	}
	// A literal type (func, map, slice, struct): no named members.
	return nil, false
}

// inner are the types t's members may come from besides its own: its
// embedded types and the type it is defined from.
func (t *typeInfo) inner() []ast.Expr {
	if t.under == nil {
		return t.embeds
	}
	return append(t.embeds[:len(t.embeds):len(t.embeds)], t.under)
}

// member reports whether t has a field or method called name, its own or
// promoted from an embedded type. opaque is true when the answer is
// unknown: t embeds, or is defined from, a type outside the repository.
func (x *codeIndex) member(t *typeInfo, name string) (found, opaque bool) {
	return x.memberSeen(t, name, map[*typeInfo]bool{})
}

func (x *codeIndex) memberSeen(t *typeInfo, name string, seen map[*typeInfo]bool) (found, opaque bool) {
	if seen[t] {
		return false, false
	}
	seen[t] = true
	if _, ok := t.fields[name]; ok || t.methods[name] {
		return true, false
	}
	for _, e := range t.inner() {
		et, external := x.resolve(t, e)
		if external {
			opaque = true
			continue
		}
		if et == nil {
			continue
		}
		f, o := x.memberSeen(et, name, seen)
		if f {
			return true, false
		}
		opaque = opaque || o
	}
	return false, opaque
}

// fieldType is the named type of t's field name (promoted fields
// included), or nil when name is a method, is not there, or its type is
// not a named type of the repository.
func (x *codeIndex) fieldType(t *typeInfo, name string) *typeInfo {
	return x.fieldTypeSeen(t, name, map[*typeInfo]bool{})
}

func (x *codeIndex) fieldTypeSeen(t *typeInfo, name string, seen map[*typeInfo]bool) *typeInfo {
	if seen[t] {
		return nil
	}
	seen[t] = true
	if e, ok := t.fields[name]; ok {
		ft, _ := x.resolve(t, e)
		return ft
	}
	for _, e := range t.inner() {
		if et, _ := x.resolve(t, e); et != nil {
			if ft := x.fieldTypeSeen(et, name, seen); ft != nil {
				return ft
			}
		}
	}
	return nil
}
