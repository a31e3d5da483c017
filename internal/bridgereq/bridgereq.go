// Package bridgereq is what the request fronts (httpbridge, grpcbridge)
// share: the ledger request a client's key becomes (scope, tenant,
// principal isolation, TTL, fingerprint), the key limits that follow from
// it, its validation and the line between a key the client must change
// and a server fault, and the context a handler reads its transaction and
// key from. Each front keeps what is its protocol's: reading the key, and
// the answers it gives.
package bridgereq

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/fingerprint"
)

// Spec is the key policy of one route or method, fixed when the bridge is
// set up.
type Spec struct {
	Scope     string
	Source    inbox.Source
	TTL       time.Duration // 0: the ledger's default
	ResultTTL time.Duration // the stored response's clock; 0: the ledger's
	LockWait  time.Duration
	Principal inbox.PrincipalPolicy
	// NewRequest makes the fingerprint part of the ledger ID, so that the
	// same key with another request is a new request (the HTTP bridge's
	// MismatchNewRequest).
	NewRequest bool
	// KeyRate, when set, limits the new keys of each tenant per window
	// (CountNewKey).
	KeyRate *inbox.KeyRate
	// Observe records keys under Scope + ObserveSuffix (observe mode).
	Observe bool
	// AcquireWait is the request's inbox.Request.AcquireWait: the bound
	// on its wait for a database connection (the front's
	// Config.AcquireWait).
	AcquireWait time.Duration
}

// DefaultAcquireWait is the fronts' default Config.AcquireWait.
const DefaultAcquireWait = time.Second

// NewRequestSuffixLen is what NewRequest appends to the ledger ID: "~" and
// 16 base64url characters of the fingerprint.
const NewRequestSuffixLen = 17

// Validate checks the spec's fields. Its errors name the field ("Scope is
// empty"); the front wraps them as its configuration error.
func (s Spec) Validate() error {
	if s.Scope == "" {
		return errors.New("empty Scope")
	}
	if err := (inbox.Key{Scope: s.scope(), ID: "x"}).Validate(0); err != nil {
		return fmt.Errorf("invalid Scope: %w", err)
	}
	if s.KeyRate != nil {
		if err := s.KeyRate.Validate(); err != nil {
			return err
		}
	}
	switch {
	case s.Principal > inbox.PrincipalShared:
		return fmt.Errorf("unknown PrincipalPolicy %d", s.Principal)
	case s.TTL < 0:
		return errors.New("TTL is negative")
	case s.ResultTTL < 0:
		return errors.New("ResultTTL is negative")
	case s.LockWait < 0:
		return errors.New("LockWait is negative")
	case s.AcquireWait < 0:
		return errors.New("AcquireWait is negative")
	}
	return nil
}

// MaxKeyLen is the longest client key the route or method takes: limit
// (the front's own, at most inbox.MaxPartLen), capped at inbox.MaxPartLen
// less what the ledger ID appends to the key: the principal's digest
// under PrincipalIsolated when the front knows principals (principals: its
// Config.Principal is set), and the fingerprint with NewRequest.
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
		Key:         inbox.Key{Scope: s.scope(), Tenant: tenant, ID: key},
		Principal:   principal,
		Fingerprint: fp,
		Source:      s.Source,
		TTL:         s.TTL,
		ResultTTL:   s.ResultTTL,
		LockWait:    s.LockWait,
		AcquireWait: s.AcquireWait,
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

// scope is the ledger scope of the spec's keys: Scope, with ObserveSuffix
// in observe mode.
func (s *Spec) scope() string {
	if s.Observe {
		return s.Scope + ObserveSuffix
	}
	return s.Scope
}

// CountNewKey counts a new key of tenant against the spec's KeyRate (see
// inbox.Ledger.CountNewKey), under the spec's scope unless the KeyRate
// names its count. Without a KeyRate it counts nothing and returns nil.
func (s *Spec) CountNewKey(ctx context.Context, l *inbox.Ledger, tx pgx.Tx, tenant string) (*inbox.NewKeyCount, error) {
	if s.KeyRate == nil {
		return nil, nil
	}
	return l.CountNewKey(ctx, tx, *s.KeyRate, s.Scope, tenant)
}

// Do runs fn for *req through l.Do, as both bridges do: the key, once
// claimed as new, is counted against the spec's KeyRate before fn runs (a
// key over the limit ends the call: fn does not run); a Mismatch against a
// plain fingerprint stored before detailed ones (PlainRetry) is asked
// again with the plain form, which is left in req; a count whose key did
// not commit is taken back. A key the count refuses, before fn or at
// commit, is a *inbox.KeyRateError; other errors are Do's.
func (s *Spec) Do(ctx context.Context, l *inbox.Ledger, req *inbox.Request, fn inbox.TxFunc) (inbox.Outcome, error) {
	var count *inbox.NewKeyCount
	run := func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		count.Undo(ctx) // an earlier run's: the ledger claims again after a conflict
		var err error
		if count, err = s.CountNewKey(ctx, l, tx, req.Tenant); err != nil {
			return inbox.Result{}, err
		}
		return fn(ctx, tx)
	}
	out, err := l.Do(ctx, *req, run)
	if err == nil && PlainRetry(out, req) {
		out, err = l.Do(ctx, *req, run)
	}
	if err != nil || out.Disposition != inbox.Executed {
		count.Undo(ctx)
	}
	if kre, ok := count.Refused(err); ok {
		return out, kre
	}
	return out, err
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

// Expiry is when the key of a request the ledger answered with out stops
// being recognised: its row's expiry when the answer came with the row
// (first run, replay, mismatch, a lease in flight), else (a request in
// flight whose transaction has not committed its row) a lower bound: the
// holder claimed the key at most handlerTimeout ago, so its row will
// expire no earlier than now + ttl - handlerTimeout. ok is false for an
// outcome that concerns no key.
func Expiry(out inbox.Outcome, now time.Time, ttl, handlerTimeout time.Duration) (t time.Time, ok bool) {
	switch {
	case out.Record != nil && !out.Record.ExpiresAt.IsZero():
		return out.Record.ExpiresAt, true
	case out.Disposition == inbox.InFlight:
		return now.Add(ttl - handlerTimeout), true
	}
	return time.Time{}, false
}

// PlainRetry prepares a second ledger call for a Mismatch whose stored
// fingerprint is the plain (version 1) form of the request's detailed
// one: a key recorded before detailed fingerprints, for the same request.
// It sets req's fingerprint to the plain form, so that the ledger compares
// it as it did then, and reports whether to call again.
func PlainRetry(out inbox.Outcome, req *inbox.Request) bool {
	if out.Disposition != inbox.Mismatch || out.Record == nil || len(req.Fingerprint) == 0 ||
		req.Fingerprint[0] != fingerprint.DetailVersion || len(out.Record.Fingerprint) == 0 ||
		out.Record.Fingerprint[0] != fingerprint.PlainVersion {
		return false
	}
	plain := fingerprint.Plain(req.Fingerprint)
	if !bytes.Equal(plain, out.Record.Fingerprint) {
		return false
	}
	req.Fingerprint = plain
	return true
}

// Differences names what differs between the request and the one a
// Mismatch's row was recorded for (see fingerprint.Differences), or nil
// when the stored fingerprint cannot tell (a plain one, from a release
// before detailed fingerprints).
func Differences(out inbox.Outcome, fp []byte) []string {
	if out.Record == nil {
		return nil
	}
	diff, err := fingerprint.Differences(out.Record.Fingerprint, fp)
	if err != nil {
		return nil
	}
	return diff
}

// What an observe-mode route or method would have done with a request it
// let through: the values of the would label of the observe counter.
const (
	// WouldRun: a new key; its handler would have run, as it did.
	WouldRun = "would_run"
	// WouldReplay: a known key (completed, failed for good, or run by
	// another front); the bridge would have answered from the ledger
	// without running the handler.
	WouldReplay = "would_replay"
	// WouldRefuseMissingKey: no key on a route or method that requires
	// one.
	WouldRefuseMissingKey = "would_refuse_missing_key"
	// WouldRefuseInvalidKey: a key the bridge would have refused.
	WouldRefuseInvalidKey = "would_refuse_invalid_key"
	// WouldConflict: a key in flight.
	WouldConflict = "would_conflict"
	// WouldMismatch: a known key with another request.
	WouldMismatch = "would_mismatch"
)

// ObserveSuffix is appended to the scope of the keys an observe-mode route
// or method records, so that they never meet the keys of enforcing routes:
// switching a route from observing to enforcing starts from an empty key
// space, and what observe mode let run is never replayed.
const ObserveSuffix = "~observe"

// Would is the would-be disposition of a request whose key the ledger
// answered with out (from AcquireLease: a nil lease's outcome) under an
// observe scope, for a front recording source.
func Would(out inbox.Outcome, source inbox.Source) string {
	rec := out.Record
	switch {
	case out.Disposition == inbox.InFlight:
		return WouldConflict
	case out.Disposition == inbox.Mismatch && rec != nil && rec.Source != "" && rec.Source != source:
		// Another front's row: its fingerprint is of another kind; that
		// front's key is answered as done or in flight.
		if rec.Status == inbox.StatusProcessing {
			return WouldConflict
		}
		return WouldReplay
	case out.Disposition == inbox.Mismatch:
		return WouldMismatch
	}
	return WouldReplay
}

// Client is the log attributes naming who sent a request: its address and
// user agent (empty values are left out).
func Client(addr, userAgent string) []any {
	var out []any
	if addr != "" {
		out = append(out, "client", addr)
	}
	if userAgent != "" {
		out = append(out, "user_agent", userAgent)
	}
	return out
}
