package fingerprint

import (
	"bytes"
	"net/url"
	"slices"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// maxJSONDepth bounds canonicalization; deeper documents are fingerprinted
// as raw bytes.
const maxJSONDepth = 512

// canonicalJSON returns the canonical form of a JSON document (RFC 8259):
// object members sorted by key (bytewise on the decoded key, recursively;
// members whose keys are the same, or the same but for case, keep their
// order), no insignificant
// whitespace, numbers exactly as written (1.0 and 1 differ, and 2^64+1
// keeps every digit: nothing goes through float64), strings re-escaped one
// way (only '"', '\' and control characters are escaped). ok is false for
// anything that is not exactly one valid JSON value in valid UTF-8, for
// lone UTF-16 surrogate escapes (decoders turn them into U+FFFD, which would
// make distinct bodies collide) and for nesting deeper than maxJSONDepth:
// the caller then hashes the raw bytes.
func canonicalJSON(b []byte) (out []byte, ok bool) {
	if !utf8.Valid(b) {
		return nil, false
	}
	p := jsonParser{s: b}
	p.space()
	out, ok = p.value(make([]byte, 0, len(b)), 0)
	if !ok {
		return nil, false
	}
	p.space()
	if p.i != len(b) {
		return nil, false // trailing data
	}
	return out, true
}

// jsonParser is a validating recursive-descent parser that writes the
// canonical form as it goes.
type jsonParser struct {
	s []byte
	i int
}

func (p *jsonParser) space() {
	for p.i < len(p.s) {
		switch p.s[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

func (p *jsonParser) value(dst []byte, depth int) ([]byte, bool) {
	if p.i >= len(p.s) || depth > maxJSONDepth {
		return dst, false
	}
	switch c := p.s[p.i]; {
	case c == '{':
		return p.object(dst, depth)
	case c == '[':
		p.i++
		dst = append(dst, '[')
		p.space()
		if p.i < len(p.s) && p.s[p.i] == ']' {
			p.i++
			return append(dst, ']'), true
		}
		for {
			var ok bool
			if dst, ok = p.value(dst, depth+1); !ok {
				return dst, false
			}
			p.space()
			if p.i >= len(p.s) {
				return dst, false
			}
			switch p.s[p.i] {
			case ',':
				p.i++
				p.space()
				dst = append(dst, ',')
			case ']':
				p.i++
				return append(dst, ']'), true
			default:
				return dst, false
			}
		}
	case c == '"':
		str, ok := p.str()
		if !ok {
			return dst, false
		}
		return appendString(dst, str), true
	case c == '-' || '0' <= c && c <= '9':
		return p.number(dst)
	case c == 't':
		return p.literal(dst, "true")
	case c == 'f':
		return p.literal(dst, "false")
	case c == 'n':
		return p.literal(dst, "null")
	}
	return dst, false
}

type member struct {
	key        string
	start, end int // the canonical value in the scratch buffer
}

// keepFoldedOrder puts the members (sorted by key) whose keys are equal
// under Unicode case folding but not equal back in the order the document
// gave them, in the places the sort gave the group: a decoder that matches
// keys case-insensitively (Go's encoding/json does) keeps the last, so
// {"amount":2,"Amount":1} and {"Amount":1,"amount":2} mean different
// things and must not share a canonical form. Members are numbered in
// document order by their start in the scratch buffer. An object without
// such keys keeps the plain sorted order.
func keepFoldedOrder(members []member) {
	if len(members) < 2 || !slices.ContainsFunc(members, func(m member) bool { return mayFold(m.key) }) {
		return // lower-case ASCII keys: none equal another but for case
	}
	// One pass (keys come from the request: no pairwise comparison).
	groups := make(map[string][]int, len(members)) // fold key -> positions in members
	for i, m := range members {
		k := foldKey(m.key)
		groups[k] = append(groups[k], i)
	}
	for _, pos := range groups {
		if len(pos) < 2 {
			continue
		}
		group := make([]member, len(pos))
		for i, at := range pos {
			group[i] = members[at]
		}
		slices.SortStableFunc(group, func(a, b member) int { return a.start - b.start })
		for i, at := range pos {
			members[at] = group[i]
		}
	}
}

// mayFold reports whether key has an upper-case ASCII letter or a
// non-ASCII byte: only such a key can equal another but for case.
func mayFold(key string) bool {
	for i := 0; i < len(key); i++ {
		if c := key[i]; c >= utf8.RuneSelf || 'A' <= c && c <= 'Z' {
			return true
		}
	}
	return false
}

// foldKey maps s to one representative of its Unicode case-folding class:
// each rune becomes the smallest rune of its simple folding orbit.
func foldKey(s string) string {
	var b strings.Builder
	for _, r := range s {
		min := r
		for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
			if f < min {
				min = f
			}
		}
		b.WriteRune(min)
	}
	return b.String()
}

func (p *jsonParser) object(dst []byte, depth int) ([]byte, bool) {
	p.i++ // '{'
	p.space()
	if p.i < len(p.s) && p.s[p.i] == '}' {
		p.i++
		return append(dst, '{', '}'), true
	}
	var members []member
	var scratch []byte
	for {
		if p.i >= len(p.s) || p.s[p.i] != '"' {
			return dst, false
		}
		key, ok := p.str()
		if !ok {
			return dst, false
		}
		p.space()
		if p.i >= len(p.s) || p.s[p.i] != ':' {
			return dst, false
		}
		p.i++
		p.space()
		start := len(scratch)
		if scratch, ok = p.value(scratch, depth+1); !ok {
			return dst, false
		}
		members = append(members, member{key: key, start: start, end: len(scratch)})
		p.space()
		if p.i >= len(p.s) {
			return dst, false
		}
		if p.s[p.i] == '}' {
			p.i++
			break
		}
		if p.s[p.i] != ',' {
			return dst, false
		}
		p.i++
		p.space()
	}
	slices.SortStableFunc(members, func(a, b member) int { return strings.Compare(a.key, b.key) })
	keepFoldedOrder(members)
	dst = append(dst, '{')
	for i, m := range members {
		if i > 0 {
			dst = append(dst, ',')
		}
		dst = appendString(dst, m.key)
		dst = append(dst, ':')
		dst = append(dst, scratch[m.start:m.end]...)
	}
	return append(dst, '}'), true
}

func (p *jsonParser) literal(dst []byte, lit string) ([]byte, bool) {
	if !bytes.HasPrefix(p.s[p.i:], []byte(lit)) {
		return dst, false
	}
	p.i += len(lit)
	return append(dst, lit...), true
}

// number copies a number literal after checking its grammar:
// -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
func (p *jsonParser) number(dst []byte) ([]byte, bool) {
	start := p.i
	digits := func() int {
		n := 0
		for p.i < len(p.s) && '0' <= p.s[p.i] && p.s[p.i] <= '9' {
			p.i++
			n++
		}
		return n
	}
	if p.s[p.i] == '-' {
		p.i++
	}
	if p.i < len(p.s) && p.s[p.i] == '0' {
		p.i++
	} else if digits() == 0 {
		return dst, false
	}
	if p.i < len(p.s) && p.s[p.i] == '.' {
		p.i++
		if digits() == 0 {
			return dst, false
		}
	}
	if p.i < len(p.s) && (p.s[p.i] == 'e' || p.s[p.i] == 'E') {
		p.i++
		if p.i < len(p.s) && (p.s[p.i] == '+' || p.s[p.i] == '-') {
			p.i++
		}
		if digits() == 0 {
			return dst, false
		}
	}
	return append(dst, p.s[start:p.i]...), true
}

// str decodes a string token at p.i (which is '"').
func (p *jsonParser) str() (string, bool) {
	p.i++
	start := p.i
	// Fast path: no escapes.
	for p.i < len(p.s) {
		c := p.s[p.i]
		if c == '"' {
			s := string(p.s[start:p.i])
			p.i++
			return s, true
		}
		if c == '\\' {
			break
		}
		if c < 0x20 {
			return "", false
		}
		p.i++
	}
	buf := append([]byte(nil), p.s[start:p.i]...)
	for p.i < len(p.s) {
		c := p.s[p.i]
		switch {
		case c == '"':
			p.i++
			return string(buf), true
		case c < 0x20:
			return "", false
		case c != '\\':
			buf = append(buf, c)
			p.i++
			continue
		}
		if p.i+1 >= len(p.s) {
			return "", false
		}
		e := p.s[p.i+1]
		p.i += 2
		switch e {
		case '"', '\\', '/':
			buf = append(buf, e)
		case 'b':
			buf = append(buf, '\b')
		case 'f':
			buf = append(buf, '\f')
		case 'n':
			buf = append(buf, '\n')
		case 'r':
			buf = append(buf, '\r')
		case 't':
			buf = append(buf, '\t')
		case 'u':
			r, ok := p.hex4()
			if !ok {
				return "", false
			}
			if utf16.IsSurrogate(r) {
				// Only a high surrogate followed by an escaped low one.
				if r >= 0xDC00 || p.i+1 >= len(p.s) || p.s[p.i] != '\\' || p.s[p.i+1] != 'u' {
					return "", false
				}
				p.i += 2
				r2, ok := p.hex4()
				if !ok || r2 < 0xDC00 || r2 > 0xDFFF {
					return "", false
				}
				r = utf16.DecodeRune(r, r2)
			}
			buf = utf8.AppendRune(buf, r)
		default:
			return "", false
		}
	}
	return "", false
}

func (p *jsonParser) hex4() (rune, bool) {
	if p.i+4 > len(p.s) {
		return 0, false
	}
	var r rune
	for _, c := range p.s[p.i : p.i+4] {
		switch {
		case '0' <= c && c <= '9':
			r = r<<4 | rune(c-'0')
		case 'a' <= c && c <= 'f':
			r = r<<4 | rune(c-'a'+10)
		case 'A' <= c && c <= 'F':
			r = r<<4 | rune(c-'A'+10)
		default:
			return 0, false
		}
	}
	p.i += 4
	return r, true
}

const hexDigits = "0123456789abcdef"

// appendString writes s (valid UTF-8) as a JSON string, escaping only what
// JSON requires.
func appendString(dst []byte, s string) []byte {
	dst = append(dst, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			dst = append(dst, '\\', c)
		case c == '\n':
			dst = append(dst, '\\', 'n')
		case c == '\r':
			dst = append(dst, '\\', 'r')
		case c == '\t':
			dst = append(dst, '\\', 't')
		case c < 0x20:
			dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
		default:
			dst = append(dst, c)
		}
	}
	return append(dst, '"')
}

// canonicalForm returns the canonical form of a urlencoded form body:
// fields sorted by name, the values of one name in their order, encoded
// one way. ok is false when the body does not parse.
func canonicalForm(b []byte) ([]byte, bool) {
	if !utf8.Valid(b) {
		return nil, false
	}
	vals, err := url.ParseQuery(string(b))
	if err != nil {
		return nil, false
	}
	return []byte(vals.Encode()), true
}
