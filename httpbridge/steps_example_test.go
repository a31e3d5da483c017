package httpbridge_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
)

// A steps route whose step calls another justonce service (a provider
// behind its own httpbridge route) through httpretry, with the step's key
// as the provider's Idempotency-Key. The first attempt loses the
// provider's answer after the charge was made; the client's retry calls
// the provider again with the same key, and the provider replays its
// charge instead of charging twice. A third request is a replay.
func ExampleSteps() {
	pool, done := exampleDB()
	defer done()
	ledger, _ := inbox.New(pool, inbox.Config{})
	bridge, _ := httpbridge.New(httpbridge.Config{Ledger: ledger})

	// The provider: charges once per Idempotency-Key.
	var requests, charges atomic.Int64
	charge := bridge.Route(httpbridge.RouteConfig{Scope: "provider"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := charges.Add(1)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "ch_%d", n)
	}))
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		charge.ServeHTTP(w, r)
	}))
	defer provider.Close()
	client := &http.Client{Transport: &httpretry.Transport{}}

	answerLost := true
	pay := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		s := httpbridge.Steps(ctx)
		chargeID, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL, strings.NewReader(`{"cents":1250}`))
			req.Header.Set("Idempotency-Key", key) // the step's key, inbox.StepKey(s.Key(), "charge")
			resp, err := client.Do(req)
			if err != nil {
				return nil, err
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if answerLost {
				answerLost = false
				return nil, errors.New("connection lost") // charged, not recorded
			}
			return body, err
		})
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable) // 503 is not stored: retry with the key
			return
		}
		w.WriteHeader(http.StatusCreated)
		w.Write(chargeID)
	})
	h := bridge.Route(httpbridge.RouteConfig{Scope: "payments", Steps: true})(pay)
	for i := 0; i < 3; i++ {
		req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"cents":1250}`))
		req.Header.Set("Idempotency-Key", "payment-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("%d %s replayed: %t; provider: %d requests, %d charges\n", rec.Code, strings.TrimSpace(rec.Body.String()),
			rec.Header().Get("Idempotent-Replayed") == "true", requests.Load(), charges.Load())
	}
	// Output:
	// 503 connection lost replayed: false; provider: 1 requests, 1 charges
	// 201 ch_1 replayed: false; provider: 2 requests, 1 charges
	// 201 ch_1 replayed: true; provider: 2 requests, 1 charges
}
