package httpretry_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/httpretry"
)

// seen records what a test server received.
type seen struct {
	mu     sync.Mutex
	keys   []string
	bodies []string
}

func (s *seen) add(r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.keys = append(s.keys, r.Header.Get("Idempotency-Key"))
	s.bodies = append(s.bodies, string(b))
}

// scripted answers with the given statuses in turn, then 201.
func scripted(s *seen, codes ...int) http.Handler {
	var n atomic.Int64
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.add(r)
		i := int(n.Add(1)) - 1
		if i < len(codes) {
			w.WriteHeader(codes[i])
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
}

func fastTransport(base http.RoundTripper) *httpretry.Transport {
	return &httpretry.Transport{Base: base, Backoff: backoff.Backoff{Initial: time.Millisecond, Max: 20 * time.Millisecond}}
}

func TestTransportAddsKeyAndRetriesWithIt(t *testing.T) {
	t.Parallel()
	for _, codes := range [][]int{{409}, {425}, {429}, {500, 502, 503}, {504}} {
		s := &seen{}
		srv := httptest.NewServer(scripted(s, codes...))
		c := &http.Client{Transport: fastTransport(srv.Client().Transport)}
		req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{"a":1}`))
		require.NoError(t, err)
		resp, err := c.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode, codes)
		require.Len(t, s.keys, len(codes)+1)
		u, err := uuid.Parse(s.keys[0])
		require.NoError(t, err)
		require.Equal(t, uuid.Version(4), u.Version())
		for i := range s.keys {
			require.Equal(t, s.keys[0], s.keys[i], "the same key on every attempt")
			require.Equal(t, `{"a":1}`, s.bodies[i], "the body is sent again")
		}
		require.Empty(t, req.Header.Get("Idempotency-Key"), "the caller's request is not modified")
		srv.Close()
	}
}

func TestTransportDoesNotRetryOtherClientErrors(t *testing.T) {
	t.Parallel()
	for _, code := range []int{400, 401, 403, 404, 413, 422, 501, 505} {
		s := &seen{}
		srv := httptest.NewServer(scripted(s, code))
		c := &http.Client{Transport: fastTransport(srv.Client().Transport)}
		resp, err := c.Post(srv.URL, "application/json", strings.NewReader(`{}`))
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, code, resp.StatusCode)
		require.Len(t, s.keys, 1, code)
		srv.Close()
	}
}

func TestTransportGivesUpWithLastResponse(t *testing.T) {
	t.Parallel()
	s := &seen{}
	srv := httptest.NewServer(scripted(s, 503, 503, 503, 503, 503, 503))
	defer srv.Close()
	tr := fastTransport(srv.Client().Transport)
	tr.MaxAttempts = 3
	resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "text/plain", strings.NewReader("x"))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Len(t, s.keys, 3)
}

func TestTransportRetriesNetworkErrors(t *testing.T) {
	t.Parallel()
	s := &seen{}
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.add(r)
		if n.Add(1) == 1 {
			conn, _, err := http.NewResponseController(w).Hijack()
			require.NoError(t, err)
			conn.Close() // the connection drops before an answer
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	c := &http.Client{Transport: fastTransport(srv.Client().Transport)}
	resp, err := c.Post(srv.URL, "application/json", strings.NewReader(`{"pay":1}`))
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Len(t, s.keys, 2)
	require.Equal(t, s.keys[0], s.keys[1])
	require.Equal(t, s.bodies[0], s.bodies[1])
}

func TestTransportPassThroughAndExistingKeys(t *testing.T) {
	t.Parallel()
	s := &seen{}
	srv := httptest.NewServer(scripted(s, 503, 503, 503))
	defer srv.Close()
	c := &http.Client{Transport: fastTransport(srv.Client().Transport)}

	resp, err := c.Get(srv.URL) // not covered: once, no key
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Equal(t, []string{""}, s.keys)

	// PUT with the caller's own key: kept, and retried.
	req, _ := http.NewRequest(http.MethodPut, srv.URL, strings.NewReader("v"))
	req.Header.Set("Idempotency-Key", "mine")
	resp, err = c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Equal(t, []string{"", "mine", "mine", "mine"}, s.keys)
}

func TestTransportBodyWithoutGetBodyIsSentOnce(t *testing.T) {
	t.Parallel()
	s := &seen{}
	srv := httptest.NewServer(scripted(s, 503))
	defer srv.Close()
	c := &http.Client{Transport: fastTransport(srv.Client().Transport)}
	req, _ := http.NewRequest(http.MethodPost, srv.URL, io.NopCloser(strings.NewReader("stream")))
	require.Nil(t, req.GetBody)
	resp, err := c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Len(t, s.keys, 1)
	require.NotEmpty(t, s.keys[0], "still keyed")
}

func TestTransportHonoursRetryAfterAndContext(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "30")
		w.WriteHeader(http.StatusConflict)
	}))
	defer srv.Close()
	tr := &httpretry.Transport{Base: srv.Client().Transport, Backoff: backoff.Backoff{Max: time.Minute}}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("x"))
	start := time.Now()
	_, err := (&http.Client{Transport: tr}).Do(req)
	require.True(t, errors.Is(err, context.DeadlineExceeded), "%v", err)
	require.Less(t, time.Since(start), 10*time.Second, "the wait ends with the context")
}

// A request that carries its key under another accepted name keeps it and
// gets no second key: the bridge refuses two key headers that differ.
func TestTransportKeepsAnAltHeadersKey(t *testing.T) {
	t.Parallel()
	var got []http.Header
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Header.Clone())
		n := len(got)
		mu.Unlock()
		if n == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	c := &http.Client{Transport: fastTransport(srv.Client().Transport)}
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("v"))
	req.Header.Set("X-Idempotency-Key", "mine")
	resp, err := c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Len(t, got, 2, "retried with the caller's key")
	for _, h := range got {
		require.Equal(t, "mine", h.Get("X-Idempotency-Key"))
		require.Empty(t, h.Get("Idempotency-Key"), "no key of the transport's own")
	}

	// With AltHeaders empty, only Header counts: the request gets a key.
	tr := fastTransport(srv.Client().Transport)
	tr.AltHeaders = []string{}
	req, _ = http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("v"))
	req.Header.Set("X-Idempotency-Key", "mine")
	resp, err = (&http.Client{Transport: tr}).Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.NotEmpty(t, got[len(got)-1].Get("Idempotency-Key"))
}
