package httpbridge

import (
	"net/http"
	"strconv"
	"strings"

	"github.com/justonce/justonce/internal/bridgereq"
)

// keyError says why a key header was rejected; its text is the problem's
// detail, so it never includes the key itself.
type keyError struct {
	reason string
}

func (e *keyError) Error() string { return e.reason }

// Reasons for rejecting a key header.
var (
	errKeyEmpty       = &keyError{"the key is empty"}
	errKeyList        = &keyError{"the header holds a list; send exactly one key"}
	errKeyRepeated    = &keyError{"the header is repeated; send exactly one key"}
	errKeyConflict    = &keyError{"the request carries different keys under different header names"}
	errKeyParams      = &keyError{"structured-field parameters are not accepted on the key"}
	errKeyUnprintable = &keyError{"the key holds a character outside printable ASCII"}
	errKeyUnquoted    = &keyError{`the key holds a character that needs the quoted form ("...")`}
	errKeyBadString   = &keyError{"the key is not a valid structured-field string"}
	errKeyNotUUID     = &keyError{"the key must be a UUID"}
	errKeyNotUUIDv4   = &keyError{"the key must be a version 4 UUID"}
)

func errKeyTooLong(max int) *keyError {
	return &keyError{"the key is longer than " + strconv.Itoa(max) + " characters"}
}

// parseKey parses one Idempotency-Key field value, per the IETF
// Idempotency-Key header field: the value is a structured-field
// String (RFC 8941 sf-string, "..." with \" and \\ escapes). A bare value
// is accepted too, as most clients send one: any printable ASCII except
// space, '"', '\', ',' and ';'. Lists (a ',' outside the quotes),
// parameters (';'), empty keys, keys over maxLen bytes and characters
// outside printable ASCII are rejected.
func parseKey(v string, maxLen int) (string, error) {
	v = strings.Trim(v, " \t")
	if v == "" {
		return "", errKeyEmpty
	}
	var key string
	if v[0] == '"' {
		var rest string
		var err error
		key, rest, err = parseSFString(v)
		if err != nil {
			return "", err
		}
		rest = strings.TrimLeft(rest, " \t")
		switch {
		case rest == "":
		case rest[0] == ',':
			return "", errKeyList
		case rest[0] == ';':
			return "", errKeyParams
		default:
			return "", errKeyBadString
		}
	} else {
		for i := 0; i < len(v); i++ {
			switch c := v[i]; {
			case c == ',':
				return "", errKeyList
			case c == ';':
				return "", errKeyParams
			case c < 0x20 || c > 0x7e:
				return "", errKeyUnprintable
			case c == ' ' || c == '\t' || c == '"' || c == '\\':
				return "", errKeyUnquoted
			}
		}
		key = v
	}
	if key == "" {
		return "", errKeyEmpty
	}
	if len(key) > maxLen {
		return "", errKeyTooLong(maxLen)
	}
	return key, nil
}

// parseSFString parses an RFC 8941 sf-string at the start of v and returns
// its value and what follows it.
func parseSFString(v string) (val, rest string, err error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", "", errKeyBadString
			}
			b.WriteByte(v[i])
		case c == '"':
			return b.String(), v[i+1:], nil
		case c < 0x20 || c > 0x7e:
			return "", "", errKeyUnprintable
		default:
			b.WriteByte(c)
		}
	}
	return "", "", errKeyBadString
}

// formatKey is parseKey's inverse: the sf-string form of a key.
func formatKey(key string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(key); i++ {
		if key[i] == '"' || key[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(key[i])
	}
	b.WriteByte('"')
	return b.String()
}

// extractKey finds the request's key under the configured header names.
// present is false when no name is there.
func extractKey(h http.Header, names []string, maxLen int, format KeyFormat) (key string, present bool, err error) {
	for _, name := range names {
		vals := h[name]
		if len(vals) == 0 {
			continue
		}
		if len(vals) > 1 {
			return "", true, errKeyRepeated
		}
		k, err := parseKey(vals[0], maxLen)
		if err != nil {
			return "", true, err
		}
		if k, err = checkFormat(k, format); err != nil {
			return "", true, err
		}
		if present && k != key {
			return "", true, errKeyConflict
		}
		key, present = k, true
	}
	return key, present, nil
}

// checkFormat applies a route's KeyFormat; UUIDs are lower-cased so that
// a retry in the other case finds the same row.
func checkFormat(k string, f KeyFormat) (string, error) {
	switch f {
	case KeyUUID:
		if !bridgereq.IsUUID(k, false) {
			return "", errKeyNotUUID
		}
		return strings.ToLower(k), nil
	case KeyUUIDv4:
		if !bridgereq.IsUUID(k, true) {
			return "", errKeyNotUUIDv4
		}
		return strings.ToLower(k), nil
	}
	return k, nil
}
