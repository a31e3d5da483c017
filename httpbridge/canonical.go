package httpbridge

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/url"
	"slices"
	"strings"
	"unicode/utf8"
)

// maxJSONDepth bounds canonicalization; deeper documents are fingerprinted
// as raw bytes.
const maxJSONDepth = 512

var errNotCanonical = errors.New("not canonicalizable")

// canonicalJSON returns the canonical form of a JSON document: object
// members sorted by key (bytewise, recursively; members with the same key
// keep their order), no insignificant whitespace, numbers exactly as
// written (json.Number: 1.0 and 1 differ, 2^64+1 keeps every digit),
// strings re-escaped one way (only '"', '\' and control characters are
// escaped). ok is false for anything that is not exactly one valid JSON
// value in valid UTF-8, for lone UTF-16 surrogates (which the decoder would
// turn into U+FFFD, making distinct bodies collide) and for nesting deeper
// than maxJSONDepth: the caller then uses the raw bytes.
func canonicalJSON(b []byte) (out []byte, ok bool) {
	if !utf8.Valid(b) {
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	c := canonicalizer{dec: dec, src: b}
	v, err := c.value(0)
	if err != nil {
		return nil, false
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, false // trailing data
	}
	out = make([]byte, 0, len(b))
	return appendCanonical(out, v), true
}

type canonicalizer struct {
	dec *json.Decoder
	src []byte
}

// jnode is a parsed JSON value: a literal (already canonical bytes), an
// array or an object.
type jnode struct {
	lit     []byte
	arr     []jnode
	members []jmember
	kind    byte // 'l', '[', '{'
}

type jmember struct {
	key string
	val jnode
}

func (c *canonicalizer) value(depth int) (jnode, error) {
	if depth > maxJSONDepth {
		return jnode{}, errNotCanonical
	}
	start := c.dec.InputOffset()
	tok, err := c.dec.Token()
	if err != nil {
		return jnode{}, err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '[':
			n := jnode{kind: '['}
			for c.dec.More() {
				v, err := c.value(depth + 1)
				if err != nil {
					return jnode{}, err
				}
				n.arr = append(n.arr, v)
			}
			if _, err := c.dec.Token(); err != nil {
				return jnode{}, err
			}
			return n, nil
		case '{':
			n := jnode{kind: '{'}
			for c.dec.More() {
				kstart := c.dec.InputOffset()
				kt, err := c.dec.Token()
				if err != nil {
					return jnode{}, err
				}
				k, ok := kt.(string)
				if !ok {
					return jnode{}, errNotCanonical
				}
				if err := c.checkSurrogates(k, kstart); err != nil {
					return jnode{}, err
				}
				v, err := c.value(depth + 1)
				if err != nil {
					return jnode{}, err
				}
				n.members = append(n.members, jmember{key: k, val: v})
			}
			if _, err := c.dec.Token(); err != nil {
				return jnode{}, err
			}
			slices.SortStableFunc(n.members, func(a, b jmember) int { return strings.Compare(a.key, b.key) })
			return n, nil
		}
		return jnode{}, errNotCanonical
	case string:
		if err := c.checkSurrogates(t, start); err != nil {
			return jnode{}, err
		}
		return jnode{kind: 'l', lit: appendString(nil, t)}, nil
	case json.Number:
		return jnode{kind: 'l', lit: []byte(t)}, nil
	case bool:
		if t {
			return jnode{kind: 'l', lit: []byte("true")}, nil
		}
		return jnode{kind: 'l', lit: []byte("false")}, nil
	case nil:
		return jnode{kind: 'l', lit: []byte("null")}, nil
	}
	return jnode{}, errNotCanonical
}

// checkSurrogates rejects a decoded string holding more U+FFFD than its
// source spells out: the surplus came from invalid escapes (lone
// surrogates), which would make distinct bodies canonicalize alike.
func (c *canonicalizer) checkSurrogates(s string, start int64) error {
	n := strings.Count(s, "\uFFFD")
	if n == 0 {
		return nil
	}
	end := c.dec.InputOffset()
	if start < 0 || end > int64(len(c.src)) || start > end {
		return errNotCanonical
	}
	raw := c.src[start:end]
	spelled := bytes.Count(raw, []byte("\uFFFD")) + bytes.Count(bytes.ToLower(raw), []byte(`\ufffd`))
	if n > spelled {
		return errNotCanonical
	}
	return nil
}

func appendCanonical(dst []byte, n jnode) []byte {
	switch n.kind {
	case '[':
		dst = append(dst, '[')
		for i, v := range n.arr {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = appendCanonical(dst, v)
		}
		return append(dst, ']')
	case '{':
		dst = append(dst, '{')
		for i, m := range n.members {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = appendString(dst, m.key)
			dst = append(dst, ':')
			dst = appendCanonical(dst, m.val)
		}
		return append(dst, '}')
	}
	return append(dst, n.lit...)
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
