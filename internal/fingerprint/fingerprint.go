// Package fingerprint computes the content fingerprint of an HTTP request
// for the idempotency bridge: a versioned SHA-256 over the method, path,
// sorted query, media type, canonical body (JSON with sorted object keys
// and numbers kept as written; urlencoded forms with sorted fields; any
// other body raw) and chosen headers. Two requests that mean the same get
// the same fingerprint; a known key with another fingerprint is a
// mismatch.
//
// The framing (a version byte, then SHA-256 over length-prefixed fields)
// is Builder's, which the gRPC bridge uses for its own fingerprints too.
package fingerprint

import (
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
// over fields framed by a Builder with Uvarint lengths: a tag, method,
// path, query (sorted), media type, body mode and body (canonical JSON,
// sorted form fields, or raw), and each of headers' lower-cased name and
// values. body is the request's body, already read. The result is 33
// bytes.
func Request(r *http.Request, body []byte, headers []string) []byte {
	b := NewBuilder(Uvarint, "justonce-http-fp")
	b.String(r.Method)
	b.String(r.URL.Path)
	q := r.URL.RawQuery
	if vals, err := url.ParseQuery(q); err == nil {
		q = vals.Encode()
	}
	b.String(q)

	media, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		media = strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Type")))
	}
	b.String(media)
	mode, canon := canonicalBody(media, body)
	b.String(string(rune(mode)))
	b.Bytes(canon)

	for _, name := range headers {
		b.Values(strings.ToLower(name), r.Header.Values(name))
	}
	return b.Sum(Version)
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
