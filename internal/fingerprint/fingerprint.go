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
//
// The bridges store detailed fingerprints (RequestDetailed, Detailed):
// the same SHA-256, followed by short digests of the request's named parts
// (JSON members, form fields, query parameters, headers), so that a
// mismatch can say which parts differ without storing their values
// (Differences).
package fingerprint

import (
	"mime"
	"net/http"
	"net/url"
	"strings"
)

// Version is the first byte of every plain fingerprint Request returns.
// Change it (and the hashed layout) together; rows stored under another
// version then answer as a mismatch rather than as a false match. Detailed
// fingerprints (RequestDetailed) begin with DetailVersion.
const Version = PlainVersion

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
// bytes: the plain fingerprint (PlainVersion).
func Request(r *http.Request, body []byte, headers []string) []byte {
	fp, _, _, _ := request(r, body, headers)
	return fp
}

// RequestDetailed is Request's detailed fingerprint (DetailVersion): its
// plain part is Request's, and its members are "method", "path",
// "content-type", "query:<name>" for each query parameter,
// "header:<Name>" for each of headers, and the body: "body:<JSON
// pointer>" for a JSON object or array, "form:<name>" for each field of a
// form, else "body".
func RequestDetailed(r *http.Request, body []byte, headers []string) []byte {
	plain, media, mode, canon := request(r, body, headers)
	var m Members
	m.Add("method", []byte(r.Method))
	m.Add("path", []byte(r.URL.Path))
	m.Add("content-type", []byte(media))
	for _, name := range headers {
		m.AddValues("header:"+http.CanonicalHeaderKey(name), r.Header.Values(name))
	}
	if vals, err := url.ParseQuery(r.URL.RawQuery); err != nil {
		m.Add("query", []byte(r.URL.RawQuery))
	} else if len(vals) > 0 {
		m.AddGroup("query", "query:", vals)
	}
	switch mode {
	case modeJSON:
		m.AddJSON("body", "body:", canon)
	case modeForm:
		vals, _ := url.ParseQuery(string(body)) // canonicalForm parsed it
		m.AddGroup("body", "form:", vals)
	default:
		m.Add("body", []byte{mode}, canon)
	}
	return Detailed(plain, &m)
}

// request computes the plain fingerprint, and returns with it the media
// type and the body's canonical form, which RequestDetailed describes.
func request(r *http.Request, body []byte, headers []string) (fp []byte, media string, mode byte, canon []byte) {
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
	mode, canon = canonicalBody(media, body)
	b.String(string(rune(mode)))
	b.Bytes(canon)

	for _, name := range headers {
		b.Values(strings.ToLower(name), r.Header.Values(name))
	}
	return b.Sum(Version), media, mode, canon
}

// CanonicalJSON returns the canonical form of a JSON document (see the
// package documentation), and false for anything that is not exactly one
// valid JSON value; the gRPC bridge describes a request message through
// the canonical form of its JSON mapping.
func CanonicalJSON(b []byte) ([]byte, bool) { return canonicalJSON(b) }

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
