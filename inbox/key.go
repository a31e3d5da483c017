package inbox

import (
	"crypto/sha256"
	"encoding/base64"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Key names one ledger row. Scope is the operation space (a consumer group,
// an HTTP route, or a name both share); Tenant isolates tenants (empty where
// there are none); ID is the event ID or the Idempotency-Key.
type Key struct {
	Scope  string
	Tenant string
	ID     string
}

// MaxPartLen is the default limit, in bytes, of each part of a key.
const MaxPartLen = 255

// Validate checks the key against the limits: scope and ID non-empty, every
// part at most maxLen bytes, valid UTF-8, no NUL byte. It returns a *KeyError.
func (k Key) Validate(maxLen int) error {
	if maxLen <= 0 {
		maxLen = MaxPartLen
	}
	if err := checkPart("scope", k.Scope, maxLen, false); err != nil {
		return err
	}
	if err := checkPart("tenant", k.Tenant, maxLen, true); err != nil {
		return err
	}
	return checkPart("event_id", k.ID, maxLen, false)
}

func checkPart(field, v string, maxLen int, emptyOK bool) error {
	switch {
	case v == "" && !emptyOK:
		return &KeyError{Field: field, Reason: "empty"}
	case len(v) > maxLen:
		return &KeyError{Field: field, Reason: "longer than " + strconv.Itoa(maxLen) + " bytes"}
	case !utf8.ValidString(v):
		return &KeyError{Field: field, Reason: "not valid UTF-8"}
	case strings.IndexByte(v, 0) >= 0:
		return &KeyError{Field: field, Reason: "contains a NUL byte"}
	}
	return nil
}

// Mask shortens a key for logs: the first and last four characters of an ID
// longer than eight ("550e****0000"), stars otherwise.
func Mask(id string) string {
	r := []rune(id)
	if len(r) <= 8 {
		return strings.Repeat("*", len(r))
	}
	return string(r[:4]) + "****" + string(r[len(r)-4:])
}

// String returns the key with its ID masked, safe for logs.
func (k Key) String() string {
	return k.Scope + "/" + k.Tenant + "/" + Mask(k.ID)
}

// PrincipalPolicy says whether a request front's route or method isolates
// its keys per principal, when the front knows who sent a request
// (httpbridge.RouteConfig.PrincipalKeys and
// grpcbridge.MethodConfig.PrincipalKeys, with their Config.Principal set).
type PrincipalPolicy uint8

// Principal policies.
const (
	// PrincipalIsolated (the default) gives each principal its own key
	// space, like per-account keys in payment APIs: the ledger ID of a
	// request with a principal is PrincipalKeyID(key, principal). A key
	// replays only to the principal that sent it; another principal's
	// request with the same key and body runs on its own, and its answer
	// does not depend on whether the key exists for someone else, so it
	// learns nothing about other principals' keys. Requests without a
	// principal ("") keep the plain key: such a route or method shares
	// keys with a consumer only for them.
	//
	// A route or method under it takes keys of at most
	// MaxPartLen-PrincipalSuffixLen (231) bytes (fewer where the front
	// appends more to the ID), on every request, also one whose principal
	// is "": a key's limit is the route's or method's, not the caller's.
	//
	// No refusal mode is offered: refusing a key because another principal
	// holds it would tell the caller that the key exists.
	PrincipalIsolated PrincipalPolicy = iota
	// PrincipalShared keys requests by the key alone: any principal of the
	// tenant that sends the same key and request gets the stored answer.
	// The principal is recorded for audit only. Use it for a route or
	// method whose keys are shared with a consumer (the event ID is the
	// plain key), or where several principals legitimately retry one
	// operation.
	PrincipalShared
)

// PrincipalKeyID is the ledger ID under which a request front (the HTTP and
// gRPC bridges) records a client's key under PrincipalIsolated: the key,
// U+00B7 and the first 16 bytes of SHA-256(principal) in unpadded
// base64url (24 bytes after the key). Client keys are printable ASCII, so
// no key a client sends equals such an ID, and both bridges give one
// principal's key the same ID, so that it dedupes across them. Use it to
// find or release such a key (Ledger.Lookup, Ledger.Release, the CLI);
// HTTP routes with MismatchNewRequest append a fingerprint suffix after
// it.
//
// An isolated key may therefore be at most MaxPartLen-PrincipalSuffixLen
// bytes long.
func PrincipalKeyID(key, principal string) string {
	sum := sha256.Sum256([]byte(principal))
	return key + "\u00b7" + base64.RawURLEncoding.EncodeToString(sum[:16])
}

// PrincipalSuffixLen is what PrincipalKeyID appends to a key: the separator
// (2 bytes) and 22 base64url characters.
const PrincipalSuffixLen = 24
