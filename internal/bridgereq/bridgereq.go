// Package bridgereq is what the request fronts (httpbridge, grpcbridge)
// share: the ledger request a client's key becomes (scope, tenant,
// principal isolation, TTL, fingerprint), the key limits that follow from
// it, its validation and the line between a key the client must change
// and a server fault, and the context a handler reads its transaction and
// key from. Each front keeps what is its protocol's: reading the key, and
// the answers it gives.
package bridgereq

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/justonce/justonce/inbox"
)

// Spec is the key policy of one route or method, fixed when the bridge is
// set up.
type Spec struct {
	Scope     string
	Source    inbox.Source
	TTL       time.Duration // 0: the ledger's default
	LockWait  time.Duration
	Principal inbox.PrincipalPolicy
	// NewRequest makes the fingerprint part of the ledger ID, so that the
	// same key with another request is a new request (the HTTP bridge's
	// MismatchNewRequest).
	NewRequest bool
}

// NewRequestSuffixLen is what NewRequest appends to the ledger ID: "~" and
// 16 base64url characters of the fingerprint.
const NewRequestSuffixLen = 17

// Validate checks the spec's fields. Its errors name the field ("Scope is
// empty"); the front wraps them as its configuration error.
func (s Spec) Validate() error {
	if s.Scope == "" {
		return errors.New("empty Scope")
	}
	if err := (inbox.Key{Scope: s.Scope, ID: "x"}).Validate(0); err != nil {
		return fmt.Errorf("invalid Scope: %w", err)
	}
	switch {
	case s.Principal > inbox.PrincipalShared:
		return fmt.Errorf("unknown PrincipalPolicy %d", s.Principal)
	case s.TTL < 0:
		return errors.New("TTL is negative")
	case s.LockWait < 0:
		return errors.New("LockWait is negative")
	}
	return nil
}

// MaxKeyLen is the longest client key the route or method takes: limit
// (the front's own, at most inbox.MaxPartLen) less what the ledger ID
// appends to the key: the principal's digest under PrincipalIsolated when
// the front knows principals (principals: its Config.Principal is set),
// and the fingerprint with NewRequest.
//
// It does not depend on a request's principal: on an isolated route a key
// over the limit is refused even when this request's principal is "" (and
// its ID would be the plain key), so that whether a key is valid is a
// property of the route, the same for every caller and every attempt.
func (s Spec) MaxKeyLen(limit int, principals bool) int {
	n := inbox.MaxPartLen
	if s.NewRequest {
		n -= NewRequestSuffixLen
	}
	if principals && s.Principal == inbox.PrincipalIsolated {
		n -= inbox.PrincipalSuffixLen
	}
	return min(limit, n)
}

// Call returns f(r), or "" when f is nil: a front's Config.Tenant or
// Config.Principal applied to the request at hand.
func Call[R any](f func(R) string, r R) string {
	if f == nil {
		return ""
	}
	return f(r)
}

// KeyError says that the ledger refused a request's key (its ID part): the
// client must send another key. Its text is fit for the client.
type KeyError struct{ Reason string }

func (e *KeyError) Error() string { return "the key is rejected by the ledger: " + e.Reason }

// Request returns the ledger request for a client's key (as the front
// parsed it, within MaxKeyLen), the request's fingerprint, and its tenant
// and principal: the ID is PrincipalKeyID(key, principal) under
// PrincipalIsolated with a principal, with the fingerprint suffix under
// NewRequest. The ledger validates it: a refused ID is a *KeyError, the
// client's to fix; any other error (a tenant or scope the ledger refuses)
// is the server's.
func (s *Spec) Request(l *inbox.Ledger, key string, fp []byte, tenant, principal string) (inbox.Request, error) {
	r := inbox.Request{
		Key:         inbox.Key{Scope: s.Scope, Tenant: tenant, ID: key},
		Principal:   principal,
		Fingerprint: fp,
		Source:      s.Source,
		TTL:         s.TTL,
		LockWait:    s.LockWait,
	}
	if s.Principal == inbox.PrincipalIsolated && principal != "" {
		r.ID = inbox.PrincipalKeyID(key, principal)
	}
	if s.NewRequest {
		r.ID += "~" + base64.RawURLEncoding.EncodeToString(fp[1:13])
	}
	if err := l.Validate(r); err != nil {
		var ke *inbox.KeyError
		if errors.As(err, &ke) && ke.Field == "event_id" {
			return r, &KeyError{Reason: ke.Reason}
		}
		return r, err
	}
	return r, nil
}

// IsUUID reports whether s is 8-4-4-4-12 hex digits, of either case; v4
// also requires version 4 and the RFC 9562 variant.
func IsUUID(s string, v4 bool) bool {
	if len(s) != 36 {
		return false
	}
	for i := 0; i < 36; i++ {
		c := s[i]
		if i == 8 || i == 13 || i == 18 || i == 23 {
			if c != '-' {
				return false
			}
			continue
		}
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	if v4 {
		return s[14] == '4' && strings.IndexByte("89abAB", s[19]) >= 0
	}
	return true
}
