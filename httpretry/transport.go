// Package httpretry is the client side of the Idempotency-Key protocol: an
// http.RoundTripper that gives each POST and PATCH request a key and
// retries it with the same key until the server (an httpbridge route, or
// any API that honours Idempotency-Key) answers for good. It depends only
// on net/http and package backoff, so a client program does not link the
// ledger's database drivers. Package grpcretry is its gRPC counterpart.
package httpretry

import (
	"context"
	"errors"
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
}

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
		if n >= attempts || !retryable(resp, err) || ctx.Err() != nil {
			return resp, err
		}
		wait := t.delay(n)
		if resp != nil {
			if ra, ok := retryAfter(resp.Header.Get("Retry-After")); ok && ra > wait {
				wait = ra
			}
			drain(resp.Body)
		}
		wait = min(wait, t.policy().Max)
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
