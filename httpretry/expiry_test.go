package httpretry_test

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/httpretry"
)

// inFlight answers every attempt 409 with the key's expiry set to
// expiresIn after the server's Date, on a server clock skew ahead of the
// client's.
func inFlight(attempts *atomic.Int64, skew, expiresIn time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		attempts.Add(1)
		now := time.Now().Add(skew).UTC().Truncate(time.Second)
		w.Header().Set("Date", now.Format(http.TimeFormat))
		w.Header().Set("Idempotency-Key-Expires", now.Add(expiresIn).Format(http.TimeFormat))
		w.Header().Set("Retry-After", "0")
		w.WriteHeader(http.StatusConflict)
		_, _ = io.WriteString(w, `{"type":"https://justonce.dev/problems/request-in-progress"}`)
	})
}

// TestTransportStopsAtKeyExpiry: a key that expires before the next
// attempt could reach the server is not sent again; the caller gets an
// *OutcomeUnknownError with the key and the last answer, through
// http.Client's *url.Error.
func TestTransportStopsAtKeyExpiry(t *testing.T) {
	t.Parallel()
	var attempts atomic.Int64
	srv := httptest.NewServer(inFlight(&attempts, 0, time.Second))
	defer srv.Close()
	tr := fastTransport(srv.Client().Transport)
	tr.NewKey = func() string { return "order-42" }
	resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "application/json", strings.NewReader(`{}`))
	require.Nil(t, resp)
	require.ErrorIs(t, err, httpretry.ErrOutcomeUnknown)
	var ue *url.Error
	require.ErrorAs(t, err, &ue, "http.Client wraps it")
	var ou *httpretry.OutcomeUnknownError
	require.ErrorAs(t, err, &ou)
	require.Equal(t, "order-42", ou.Key)
	require.False(t, ou.Expires.IsZero())
	require.NotNil(t, ou.Response)
	require.Equal(t, http.StatusConflict, ou.Response.StatusCode)
	body, _ := io.ReadAll(ou.Response.Body)
	require.Contains(t, string(body), "request-in-progress", "the last answer's body is kept")
	require.Nil(t, ou.Err)
	require.EqualValues(t, 1, attempts.Load(), "no attempt after the key's expiry")
	require.Contains(t, err.Error(), "order-42")
}

// TestTransportReadsExpiryOnTheServersClock: the expiry is measured from
// the response's Date. A server an hour behind whose key has ten minutes
// left is retried (its expiry is in the client's past); a server an hour
// ahead whose key has a second left is not (its expiry is in the client's
// future).
func TestTransportReadsExpiryOnTheServersClock(t *testing.T) {
	t.Parallel()
	var attempts atomic.Int64
	srv := httptest.NewServer(inFlight(&attempts, -time.Hour, 10*time.Minute))
	defer srv.Close()
	tr := fastTransport(srv.Client().Transport)
	tr.MaxAttempts = 3
	resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "application/json", strings.NewReader(`{}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusConflict, resp.StatusCode, "the attempts ran out: the last answer, as before")
	require.EqualValues(t, 3, attempts.Load())

	attempts.Store(0)
	ahead := httptest.NewServer(inFlight(&attempts, time.Hour, time.Second))
	defer ahead.Close()
	_, err = (&http.Client{Transport: fastTransport(ahead.Client().Transport)}).Post(ahead.URL, "application/json", strings.NewReader(`{}`))
	require.ErrorIs(t, err, httpretry.ErrOutcomeUnknown)
	require.EqualValues(t, 1, attempts.Load())
}

// roundTrips answers attempts from a list of functions.
type roundTrips []func(*http.Request) (*http.Response, error)

func (rt *roundTrips) RoundTrip(r *http.Request) (*http.Response, error) {
	f := (*rt)[0]
	*rt = (*rt)[1:]
	return f(r)
}

// TestTransportOutcomeUnknownAfterNetworkError: the key's expiry, known
// from a first answer, passes while a later attempt gets no answer; the
// error carries the network error and no response.
func TestTransportOutcomeUnknownAfterNetworkError(t *testing.T) {
	t.Parallel()
	lost := errors.New("connection reset")
	now := time.Now().UTC().Truncate(time.Second)
	rts := roundTrips{
		func(*http.Request) (*http.Response, error) {
			h := http.Header{}
			h.Set("Date", now.Format(http.TimeFormat))
			h.Set("Idempotency-Key-Expires", now.Add(3*time.Second).Format(http.TimeFormat))
			return &http.Response{StatusCode: http.StatusServiceUnavailable, Status: "503 Service Unavailable",
				Header: h, Body: io.NopCloser(strings.NewReader(""))}, nil
		},
		func(*http.Request) (*http.Response, error) {
			// The expiry's deadline is now + 2s (less a second for Date's
			// rounding): this attempt's time out brings the next one past
			// it.
			time.Sleep(1500 * time.Millisecond)
			return nil, lost
		},
	}
	tr := &httpretry.Transport{Base: &rts, Backoff: backoff.Backoff{Initial: time.Millisecond, Max: time.Millisecond}}
	req, _ := http.NewRequest(http.MethodPost, "http://example.invalid/", strings.NewReader("x"))
	_, err := tr.RoundTrip(req)
	var ou *httpretry.OutcomeUnknownError
	require.ErrorAs(t, err, &ou)
	require.ErrorIs(t, err, lost, "it unwraps to the last attempt's error")
	require.Nil(t, ou.Response)
	require.Equal(t, now.Add(3*time.Second), ou.Expires)
	require.Empty(t, rts, "both attempts were made, no third")
}
