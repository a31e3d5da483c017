// Package httpretry is the client side of the Idempotency-Key protocol: an
// http.RoundTripper that gives each POST and PATCH request a key and
// retries it with the same key until the server (an httpbridge route, or
// any API that honours Idempotency-Key) answers for good. It depends only
// on net/http and package backoff, so a client program does not link the
// ledger's database drivers. Package grpcretry is its gRPC counterpart.
package httpretry

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/justonce/justonce/backoff"
)

// Transport is an http.RoundTripper that gives POST and
// PATCH requests without a key a fresh UUID v4 key, and retries them with
// the same key on 409, 425, 429, 5xx (except 501 and 505) and network
// errors, with exponential backoff and jitter. Other 4xx answers are
// returned at once. The zero value is ready to use:
//
//	client := &http.Client{Transport: &httpretry.Transport{}}
//
// Requests with other methods pass through once, untouched, unless they
// already carry the key header (or one of AltHeaders), in which case they
// are retried too.
//
// A retry resends the body through Request.GetBody (set by http.NewRequest
// for bytes, strings and their readers); a request with a body and no
// GetBody is sent once. The last response (or error) is returned when the
// attempts run out; a Retry-After header is honoured, up to Backoff.Max
// (DefaultBackoffMax, 5 s, when unset).
//
// A server that says until when it remembers the key (ExpiresHeader, as
// httpbridge does on every answer about a key) is not sent the key after
// that time, when it would run the request as a new one: instead of such
// a retry, RoundTrip returns an *OutcomeUnknownError (ErrOutcomeUnknown),
// carrying the key and the last answer, as whether the operation happened
// is then unknown.
type Transport struct {
	// Base sends the requests. Nil: http.DefaultTransport.
	Base http.RoundTripper
	// Header names the key header. Default "Idempotency-Key".
	Header string
	// AltHeaders are other names of the key header that a request may
	// already carry. Nil means {"X-Idempotency-Key"}, the names
	// httpbridge accepts by default; an empty non-nil slice means Header
	// only. A request carrying one of them keeps it, gets no key of its
	// own (the bridge refuses a request whose two key headers differ) and
	// is retried like one carrying Header.
	AltHeaders []string
	// Methods given a key when they have none. Default POST and PATCH.
	Methods []string
	// MaxAttempts, the first included. Default 4 (retries after about
	// 100, 200 and 400 ms).
	MaxAttempts int
	// Backoff between attempts. Its Max also caps a Retry-After. Unset
	// fields: 100 ms, DefaultBackoffMax (5 s), multiplier 2.
	Backoff backoff.Backoff
	// NewKey makes a key. Default: a random UUID v4.
	NewKey func() string
	// ExpiresHeader names the response header that says until when the
	// server remembers the key (an HTTP-date). Default
	// DefaultExpiresHeader, the one httpbridge sends.
	ExpiresHeader string
}

// DefaultExpiresHeader is the response header that says until when the
// server remembers the request's key.
const DefaultExpiresHeader = "Idempotency-Key-Expires"

// ExpiryMargin is how long before the key's expiry the transport stops
// retrying with it: a retry must reach the server before the key expires.
// The expiry is read against the response's Date header, so that the
// client's clock does not matter; without a Date header it is compared
// with the client's clock.
const ExpiryMargin = time.Second

// ErrOutcomeUnknown: a request was not retried because its key had expired
// (or would have by the time of the retry) on the server, which would then
// have run it as a new operation; whether the earlier attempts' operation
// happened is unknown. The error is an *OutcomeUnknownError. Find out from
// the resource itself (a GET), then send the operation again, if need be,
// with a new key.
var ErrOutcomeUnknown = errors.New("httpretry: the key expired before the outcome was known")

// OutcomeUnknownError is the error of a request not retried because its
// key expired. It matches ErrOutcomeUnknown, and unwraps to the last
// attempt's error when that attempt got no answer.
type OutcomeUnknownError struct {
	// Key is the request's idempotency key.
	Key string
	// Expires is when the server said the key expires, on the server's
	// clock.
	Expires time.Time
	// Response is the last answer (a 409 or a 503, say), its body read
	// into memory (at most 64 KiB) so that it can be read after the
	// connection is gone; nil when the last attempt got no answer.
	Response *http.Response
	// Err is the last attempt's error when it got no answer.
	Err error
}

// Error names the key, its expiry and the last attempt's answer.
func (e *OutcomeUnknownError) Error() string {
	last := "no answer"
	switch {
	case e.Response != nil:
		last = e.Response.Status
	case e.Err != nil:
		last = e.Err.Error()
	}
	return fmt.Sprintf("httpretry: key %s expired at %s before the outcome was known (last attempt: %s)",
		e.Key, e.Expires.UTC().Format(time.RFC3339), last)
}

// Is makes an *OutcomeUnknownError match ErrOutcomeUnknown.
func (e *OutcomeUnknownError) Is(target error) bool { return target == ErrOutcomeUnknown }

// Unwrap returns the last attempt's error, if it got no answer.
func (e *OutcomeUnknownError) Unwrap() error { return e.Err }

// DefaultHeader is the request header that carries the key.
const DefaultHeader = "Idempotency-Key"

// DefaultBackoffMax is the longest wait between attempts, and the cap of a
// Retry-After, when Transport.Backoff.Max is unset: 5 s, shorter than the
// runtime's 30 s (consumer.DefaultBackoffMax) as a caller is waiting.
const DefaultBackoffMax = 5 * time.Second

// RoundTrip implements http.RoundTripper. It does not modify req: the key
// is set on a clone.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	name := t.Header
	if name == "" {
		name = DefaultHeader
	}
	methods := t.Methods
	if len(methods) == 0 {
		methods = []string{http.MethodPost, http.MethodPatch}
	}
	alts := t.AltHeaders
	if alts == nil {
		alts = []string{"X-Idempotency-Key"}
	}
	hasKey := req.Header.Get(name) != ""
	for _, alt := range alts {
		hasKey = hasKey || req.Header.Get(alt) != ""
	}
	if !hasKey && !slices.Contains(methods, req.Method) {
		return base.RoundTrip(req)
	}
	ctx := req.Context()
	attempt := req.Clone(ctx)
	if !hasKey {
		newKey := t.NewKey
		if newKey == nil {
			newKey = uuid.NewString
		}
		attempt.Header.Set(name, newKey())
	}
	key := attempt.Header.Get(name)
	for _, alt := range alts {
		if key == "" {
			key = attempt.Header.Get(alt)
		}
	}
	expiresHeader := t.ExpiresHeader
	if expiresHeader == "" {
		expiresHeader = DefaultExpiresHeader
	}
	var exp expiry
	attempts := t.MaxAttempts
	if attempts <= 0 {
		attempts = 4
	}
	replayable := req.Body == nil || req.Body == http.NoBody || req.GetBody != nil
	if !replayable {
		attempts = 1
	}
	for n := 1; ; n++ {
		if n > 1 && req.GetBody != nil {
			body, err := req.GetBody()
			if err != nil {
				return nil, err
			}
			attempt = attempt.Clone(ctx)
			attempt.Body = body
		}
		resp, err := base.RoundTrip(attempt)
		if resp != nil {
			exp.update(resp.Header, expiresHeader, time.Now())
		}
		if n >= attempts || !retryable(resp, err) || ctx.Err() != nil {
			return resp, err
		}
		wait := t.delay(n)
		if resp != nil {
			if ra, ok := retryAfter(resp.Header.Get("Retry-After")); ok && ra > wait {
				wait = ra
			}
		}
		wait = min(wait, t.policy().Max)
		if exp.passedBy(time.Now().Add(wait + ExpiryMargin)) {
			return nil, exp.unknown(key, resp, err)
		}
		if resp != nil {
			drain(resp.Body)
		}
		if err := backoff.Sleep(ctx, wait); err != nil {
			return nil, err
		}
	}
}

// retryable: 409, 425, 429, 5xx but 501 and 505, and network errors.
func retryable(resp *http.Response, err error) bool {
	if err != nil {
		return !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
	}
	switch c := resp.StatusCode; {
	case c == http.StatusConflict, c == http.StatusTooEarly, c == http.StatusTooManyRequests:
		return true
	case c == http.StatusNotImplemented, c == http.StatusHTTPVersionNotSupported:
		return false
	default:
		return c >= 500 && c < 600
	}
}

// delay is the wait after failed attempt n (from 1).
func (t *Transport) delay(n int) time.Duration { return t.policy().Delay(n) }

// policy is t.Backoff with the client's default Max.
func (t *Transport) policy() backoff.Backoff {
	return t.Backoff.Or(backoff.Backoff{Max: DefaultBackoffMax})
}

// retryAfter parses a Retry-After value: delta seconds or an HTTP date.
func retryAfter(v string) (time.Duration, bool) {
	if v == "" {
		return 0, false
	}
	if s, err := strconv.ParseInt(v, 10, 64); err == nil && s >= 0 {
		return time.Duration(min(s, 1<<20)) * time.Second, true
	}
	if at, err := http.ParseTime(v); err == nil {
		return max(time.Until(at), 0), true
	}
	return 0, false
}

// drain reads a little of a discarded body so the connection can be reused.
func drain(b io.ReadCloser) {
	_, _ = io.CopyN(io.Discard, b, 64<<10)
	_ = b.Close()
}

// expiry is what the server said of the key's expiry, on the client's
// clock.
type expiry struct {
	at       time.Time // the server's value
	deadline time.Time // the same instant on the client's clock
}

// update reads the expiry header of a response received at now.
func (e *expiry) update(h http.Header, name string, now time.Time) {
	at, err := http.ParseTime(h.Get(name))
	if err != nil {
		return
	}
	e.at, e.deadline = at, at
	if date, err := http.ParseTime(h.Get("Date")); err == nil {
		// Both on the server's clock; Date is rounded down to the second,
		// so the time left may be up to a second less than it reads.
		e.deadline = now.Add(at.Sub(date) - time.Second)
	}
}

// passedBy reports whether the key will have expired by t.
func (e *expiry) passedBy(t time.Time) bool { return !e.deadline.IsZero() && !t.Before(e.deadline) }

// unknown is the error for a retry not sent: the last answer, its body
// read into memory.
func (e *expiry) unknown(key string, resp *http.Response, err error) *OutcomeUnknownError {
	ou := &OutcomeUnknownError{Key: key, Expires: e.at, Err: err}
	if resp != nil {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		_ = resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(b))
		ou.Response = resp
	}
	return ou
}
