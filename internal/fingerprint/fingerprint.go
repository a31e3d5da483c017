// Package fingerprint computes the content fingerprint of an HTTP request
// for the idempotency bridge: a versioned SHA-256 over the method, path,
// sorted query, media type, canonical body (JSON with sorted object keys
// and numbers kept as written; urlencoded forms with sorted fields; any
// other body raw) and chosen headers. Two requests that mean the same get
// the same fingerprint; a known key with another fingerprint is a
// mismatch.
package fingerprint

import (
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"mime"
	"net/http"
	"net/url"
	"strings"
)

// Version is the first byte of every fingerprint. Change it (and
// the hashed layout) together; rows stored under another version then
// answer as a mismatch rather than as a false match.
const Version = 1

// Body canonicalization modes, hashed with the body so that a raw body can
// never equal a canonical one.
const (
	modeRaw  = 'r'
	modeJSON = 'j'
	modeForm = 'f'
)

// Request identifies a request's content: version byte, then SHA-256
// over length-prefixed fields: method, path, query (sorted), media type,
// body mode and body (canonical JSON, sorted form fields, or raw), and each
// of headers' lower-cased name and values. body is the request's body,
// already read. The result is 33 bytes.
func Request(r *http.Request, body []byte, headers []string) []byte {
	h := sha256.New()
	field(h, "justonce-http-fp")
	field(h, r.Method)
	field(h, r.URL.Path)
	q := r.URL.RawQuery
	if vals, err := url.ParseQuery(q); err == nil {
		q = vals.Encode()
	}
	field(h, q)

	media, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		media = strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Type")))
	}
	field(h, media)
	mode, canon := canonicalBody(media, body)
	field(h, string(rune(mode)))
	fieldBytes(h, canon)

	for _, name := range headers {
		vals := r.Header.Values(name)
		field(h, strings.ToLower(name))
		writeLen(h, len(vals))
		for _, v := range vals {
			field(h, v)
		}
	}
	return h.Sum([]byte{Version})
}

// canonicalBody picks the body's canonical form by media type.
func canonicalBody(media string, body []byte) (byte, []byte) {
	switch {
	case len(body) == 0:
		return modeRaw, body
	case media == "application/json" || strings.HasSuffix(media, "+json"):
		if c, ok := canonicalJSON(body); ok {
			return modeJSON, c
		}
	case media == "application/x-www-form-urlencoded":
		if c, ok := canonicalForm(body); ok {
			return modeForm, c
		}
	}
	return modeRaw, body
}

func writeLen(h hash.Hash, n int) {
	var b [binary.MaxVarintLen64]byte
	h.Write(b[:binary.PutUvarint(b[:], uint64(n))])
}

func field(h hash.Hash, s string) {
	writeLen(h, len(s))
	h.Write([]byte(s))
}

func fieldBytes(h hash.Hash, b []byte) {
	writeLen(h, len(b))
	h.Write(b)
}
