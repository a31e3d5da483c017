package fingerprint

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"hash"
	"io"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// A detailed fingerprint names what differs between two requests under one
// key (a 422 key-reused answer lists them), never their values. It is
//
//	DetailVersion, then the 32 bytes of the plain fingerprint's SHA-256,
//	then zero or more members: Uvarint(len(name)) name digest
//
// where the plain fingerprint (version PlainVersion: the version byte and
// the same SHA-256) is what releases before detailed fingerprints stored,
// so that Plain turns a detailed fingerprint back into it and a stored
// plain one still compares (see Plain). A member is a named part of the
// request: "method", "path", "content-type", "query:page",
// "header:X-Tenant", "form:amount", "body:/customer/email" (a JSON
// pointer), or, for a gRPC call, "message:/amount" and "metadata:x-tenant";
// its digest is the first DigestLen bytes of a SHA-256 over its full name
// and its value. Members are sorted by name and digest.
//
// Size is bounded: at most MaxMembers members, names cut to MaxNameLen
// bytes, and at most MaxSectionBytes after the plain part. A request with
// more parts is described more coarsely: a JSON document by its members
// down to a lesser depth (at depth 0 it is one member, "body"), then a
// query or form by one member for all its fields; when even that does not
// fit, the fingerprint has no members and a mismatch names nothing.
//
// The member section is a function of the request alone, so two detailed
// fingerprints are equal exactly when their plain parts are: the ledger
// compares them as opaque bytes. Change DetailVersion with the member
// rules (names, digests, limits): a fingerprint stored under other rules
// then answers as a mismatch rather than as a false match.
const (
	PlainVersion    = 1
	DetailVersion   = 2
	MaxMembers      = 32
	MaxNameLen      = 64
	DigestLen       = 6
	MaxSectionBytes = 1024

	plainLen    = 1 + sha256.Size
	maxDocDepth = 32
)

// ErrNotDetailed says that a fingerprint carries no member digests: it is
// a plain one, or a detailed one whose request had too many parts.
var ErrNotDetailed = errors.New("fingerprint: no member digests")

type entry struct {
	name   string // cut to MaxNameLen
	digest [DigestLen]byte
}

// group is a set of members that may be collapsed into one (a query's
// parameters into "query").
type group struct {
	whole entry
	parts []entry
}

// doc is a JSON document whose members are chosen by depth.
type doc struct {
	whole, prefix string
	canon         []byte
	// count[d] and size[d]: members and their encoded bytes when the
	// document is described down to depth d (0: the whole document).
	count, size [maxDocDepth + 1]int
	deepest     int
	limit       int // the deepest level that can be described
}

// Members collects the named parts of a request for a detailed
// fingerprint. The zero value is ready to use; it is not safe for
// concurrent use.
type Members struct {
	fixed  []entry
	groups []group
	doc    *doc
	h      hash.Hash // reused for every member's digest
	sum    [sha256.Size]byte
}

// Add adds a member that is always kept (a header, the method): name and
// the digest of its values.
func (m *Members) Add(name string, values ...[]byte) {
	m.fixed = append(m.fixed, m.entry(name, values...))
}

// AddValues adds a member whose values are strings (a header's, a
// metadata key's).
func (m *Members) AddValues(name string, values []string) {
	m.fixed = append(m.fixed, m.stringEntry(name, values))
}

// AddGroup adds vals as one member per name (prefix + name), collapsed
// into the one member whole when the fingerprint would be too large.
func (m *Members) AddGroup(whole, prefix string, vals url.Values) {
	g := group{whole: m.entry(whole, []byte(vals.Encode()))}
	names := make([]string, 0, len(vals))
	for k := range vals {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		g.parts = append(g.parts, m.stringEntry(prefix+k, vals[k]))
	}
	m.groups = append(m.groups, g)
}

// AddJSON adds a JSON document in canonical form (as canonicalJSON writes
// it): its members by JSON pointer, prefix + pointer, down to the depth the
// size limits allow, or the one member whole.
func (m *Members) AddJSON(whole, prefix string, canon []byte) {
	d := &doc{whole: whole, prefix: prefix, canon: canon, limit: maxDocDepth}
	// A leaf is a member at every depth from its own on; a container
	// (a non-empty object or array) only at its own depth. A level with
	// more nodes than MaxMembers can never be described member by member,
	// nor can any deeper one (describing a level deeper only adds
	// members): the walk goes no deeper than the level above it.
	var leafCount, leafSize [maxDocDepth + 1]int
	var nodes [maxDocDepth + 1]int
	var ptr []byte
	walkJSON(canon, 0, 0, &ptr, &d.limit, func(depth int, ptr []byte, start, end int) bool {
		if nodes[depth]++; nodes[depth] > MaxMembers && depth-1 < d.limit {
			d.limit = depth - 1
		}
		n := len(prefix) + len(ptr)
		if depth == 0 {
			n = len(whole)
		}
		if end < 0 {
			d.count[depth]++
			d.size[depth] += entrySize(n)
			if depth < d.limit {
				d.deepest = max(d.deepest, depth+1)
				return true
			}
		} else {
			leafCount[depth]++
			leafSize[depth] += entrySize(n)
		}
		d.deepest = max(d.deepest, depth)
		return false
	})
	count, size := 0, 0
	for k := range d.count {
		count, size = count+leafCount[k], size+leafSize[k]
		d.count[k] += count
		d.size[k] += size
	}
	m.doc = d
}

// Detailed returns the detailed fingerprint of a request whose plain
// fingerprint is plain, with the members m (nil: none).
func Detailed(plain []byte, m *Members) []byte {
	out := make([]byte, 0, plainLen+256)
	out = append(out, DetailVersion)
	out = append(out, plain[1:plainLen]...)
	if m == nil {
		return out
	}
	entries, ok := m.choose()
	if !ok {
		return out
	}
	slices.SortFunc(entries, func(a, b entry) int {
		if c := strings.Compare(a.name, b.name); c != 0 {
			return c
		}
		return slices.Compare(a.digest[:], b.digest[:])
	})
	for _, e := range entries {
		out = binary.AppendUvarint(out, uint64(len(e.name)))
		out = append(out, e.name...)
		out = append(out, e.digest[:]...)
	}
	return out
}

// choose picks the members within the limits, giving up detail where
// there is most of it first: a group collapsed into one member when it has
// more members than the document at its current depth, else the document
// described one level less deep. ok is false when nothing fits.
func (m *Members) choose() ([]entry, bool) {
	depth := 0
	if m.doc != nil {
		depth = min(m.doc.deepest, m.doc.limit)
	}
	collapsed := make([]bool, len(m.groups))
	for {
		n, size := len(m.fixed), 0
		for _, e := range m.fixed {
			size += entrySize(len(e.name))
		}
		for i, g := range m.groups {
			if collapsed[i] {
				n, size = n+1, size+entrySize(len(g.whole.name))
				continue
			}
			for _, e := range g.parts {
				n, size = n+1, size+entrySize(len(e.name))
			}
		}
		if m.doc != nil {
			n, size = n+m.doc.count[depth], size+m.doc.size[depth]
		}
		if n <= MaxMembers && size <= MaxSectionBytes {
			break
		}
		// Give up detail where there is most: the largest group, or the
		// document's deepest level.
		largest := -1
		for i, g := range m.groups {
			if !collapsed[i] && len(g.parts) > 1 && (largest < 0 || len(g.parts) > len(m.groups[largest].parts)) {
				largest = i
			}
		}
		switch {
		case largest >= 0 && (depth == 0 || len(m.groups[largest].parts) > m.doc.count[depth]):
			collapsed[largest] = true
		case depth > 0:
			depth--
		default:
			return nil, false
		}
	}
	entries := slices.Clone(m.fixed)
	for i, g := range m.groups {
		if collapsed[i] {
			entries = append(entries, g.whole)
		} else {
			entries = append(entries, g.parts...)
		}
	}
	if d := m.doc; d != nil {
		var ptr []byte
		limit := depth
		walkJSON(d.canon, 0, 0, &ptr, &limit, func(k int, ptr []byte, start, end int) bool {
			if end < 0 && k < depth {
				return true
			}
			if end < 0 {
				end = skipValue(d.canon, start)
			}
			name := d.whole
			if k > 0 {
				name = d.prefix + string(ptr)
			}
			entries = append(entries, m.entry(name, d.canon[start:end]))
			return false
		})
	}
	return entries, true
}

// Plain returns the plain fingerprint (PlainVersion) of a detailed one,
// and fp itself when it is not detailed. A bridge compares a stored plain
// fingerprint (from a release before detailed ones) with Plain of the
// request's.
func Plain(fp []byte) []byte {
	if len(fp) < plainLen || fp[0] != DetailVersion {
		return fp
	}
	out := make([]byte, plainLen)
	out[0] = PlainVersion
	copy(out[1:], fp[1:plainLen])
	return out
}

// Differences names the members in which two detailed fingerprints differ
// (present in one only, or with other digests), sorted, without the
// members under another that differs too ("body:/a/b" under "body:/a").
// It returns ErrNotDetailed when either carries no members, and an error
// when either is malformed.
func Differences(stored, current []byte) ([]string, error) {
	a, err := members(stored)
	if err != nil {
		return nil, err
	}
	b, err := members(current)
	if err != nil {
		return nil, err
	}
	byName := map[string][2][]string{}
	for i, es := range [2][]entry{a, b} {
		for _, e := range es {
			v := byName[e.name]
			v[i] = append(v[i], string(e.digest[:]))
			byName[e.name] = v
		}
	}
	var diff []string
	for name, v := range byName {
		if !slices.Equal(v[0], v[1]) {
			diff = append(diff, name)
		}
	}
	slices.Sort(diff)
	out := diff[:0]
	for _, name := range diff {
		if !slices.ContainsFunc(diff, func(anc string) bool { return under(name, anc) }) {
			out = append(out, name)
		}
	}
	return out, nil
}

// under reports whether member name is part of member anc: "body:/a/b"
// of "body:/a", "body:/a" of "body", "query:page" of "query".
func under(name, anc string) bool {
	return len(name) > len(anc) && strings.HasPrefix(name, anc) && (name[len(anc)] == '/' || name[len(anc)] == ':')
}

// members decodes a detailed fingerprint's member section.
func members(fp []byte) ([]entry, error) {
	if len(fp) < plainLen || fp[0] != DetailVersion || len(fp) == plainLen {
		return nil, ErrNotDetailed
	}
	var out []entry
	for p := fp[plainLen:]; len(p) > 0; {
		n, k := binary.Uvarint(p)
		if k <= 0 || n > MaxNameLen || uint64(len(p)-k) < n+DigestLen {
			return nil, errors.New("fingerprint: malformed member section")
		}
		var e entry
		e.name = string(p[k : k+int(n)])
		copy(e.digest[:], p[k+int(n):])
		out = append(out, e)
		p = p[k+int(n)+DigestLen:]
	}
	return out, nil
}

// entry is the member name (cut to MaxNameLen) with the digest of its
// full name and values.
func (m *Members) entry(name string, values ...[]byte) entry {
	h := m.begin(name)
	for _, v := range values {
		m.put(h, len(v))
		h.Write(v)
	}
	return m.end(h, name)
}

// stringEntry is entry for string values.
func (m *Members) stringEntry(name string, values []string) entry {
	h := m.begin(name)
	for _, v := range values {
		m.put(h, len(v))
		_, _ = io.WriteString(h, v)
	}
	return m.end(h, name)
}

func (m *Members) begin(name string) hash.Hash {
	if m.h == nil {
		m.h = sha256.New()
	}
	h := m.h
	h.Reset()
	m.put(h, len(name))
	_, _ = io.WriteString(h, name)
	return h
}

// put writes a length, as a Uvarint, before each field.
func (m *Members) put(h hash.Hash, n int) {
	h.Write(binary.AppendUvarint(m.sum[:0], uint64(n)))
}

func (m *Members) end(h hash.Hash, name string) entry {
	e := entry{name: cut(name)}
	copy(e.digest[:], h.Sum(m.sum[:0]))
	return e
}

// cut shortens a name to MaxNameLen bytes at a rune boundary.
func cut(name string) string {
	if len(name) <= MaxNameLen {
		return name
	}
	i := MaxNameLen
	for i > 0 && !utf8.RuneStart(name[i]) {
		i--
	}
	return name[:i]
}

// entrySize is the encoded size of a member whose full name is n bytes.
func entrySize(n int) int {
	n = min(n, MaxNameLen)
	return 1 + n + DigestLen // MaxNameLen < 128: a one-byte Uvarint
}

// walkJSON walks the canonical JSON value at c[i], at depth, whose JSON
// pointer is *ptr, and returns where it ends. visit is called for every
// value: with end < 0 for a non-empty object or array, which is walked into
// when visit returns true (and skipped otherwise), and with its end for
// anything else (scalars, {}, []). The rest of an object or array is
// skipped once *limit is under its members' depth.
func walkJSON(c []byte, i, depth int, ptr *[]byte, limit *int, visit func(depth int, ptr []byte, start, end int) bool) int {
	if c[i] != '{' && c[i] != '[' || c[i+1] == '}' || c[i+1] == ']' {
		end := skipValue(c, i)
		visit(depth, *ptr, i, end)
		return end
	}
	if !visit(depth, *ptr, i, -1) {
		return skipValue(c, i)
	}
	mark := len(*ptr)
	obj := c[i] == '{'
	j := i + 1
	for n := 0; ; n++ {
		if depth+1 > *limit {
			*ptr = (*ptr)[:mark]
			return skipValue(c, i)
		}
		*ptr = append((*ptr)[:mark], '/')
		if obj {
			keyEnd := skipValue(c, j)
			*ptr = appendPointerToken(*ptr, c[j:keyEnd])
			j = keyEnd + 1 // ':'
		} else {
			*ptr = strconv.AppendInt(*ptr, int64(n), 10)
		}
		j = walkJSON(c, j, depth+1, ptr, limit, visit)
		if c[j] != ',' {
			*ptr = (*ptr)[:mark]
			return j + 1 // '}' or ']'
		}
		j++
	}
}

// appendPointerToken appends a canonical JSON string's value as a JSON
// pointer token (RFC 6901: "~" as "~0", "/" as "~1").
func appendPointerToken(dst, quoted []byte) []byte {
	raw := quoted[1 : len(quoted)-1]
	if slices.Contains(raw, '\\') {
		p := jsonParser{s: quoted}
		s, _ := p.str()
		raw = []byte(s)
	}
	for _, b := range raw {
		switch b {
		case '~':
			dst = append(dst, '~', '0')
		case '/':
			dst = append(dst, '~', '1')
		default:
			dst = append(dst, b)
		}
	}
	return dst
}

// skipValue returns where the canonical JSON value at c[i] ends.
func skipValue(c []byte, i int) int {
	switch c[i] {
	case '"':
		for j := i + 1; j < len(c); j++ {
			switch c[j] {
			case '\\':
				j++
			case '"':
				return j + 1
			}
		}
		return len(c)
	case '{', '[':
		depth := 0
		for j := i; j < len(c); j++ {
			switch c[j] {
			case '"':
				j = skipValue(c, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1
				}
			}
		}
		return len(c)
	}
	j := i
	for j < len(c) && c[j] != ',' && c[j] != '}' && c[j] != ']' {
		j++
	}
	return j
}
