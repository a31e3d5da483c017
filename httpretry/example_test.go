package httpretry_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/justonce/justonce/httpretry"
)

// The client side: a key is added, and a 503 is retried with the same key.
func ExampleTransport() {
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys = append(keys, r.Header.Get("Idempotency-Key"))
		if len(keys) == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &httpretry.Transport{}}
	resp, err := client.Post(srv.URL, "application/json", strings.NewReader(`{"item":"book"}`))
	if err != nil {
		panic(err)
	}
	resp.Body.Close()
	fmt.Println(resp.StatusCode, len(keys), "attempts, same key:", keys[0] == keys[1], "key length:", len(keys[0]))
	// Output:
	// 201 2 attempts, same key: true key length: 36
}

// A key whose expiry passes while the operation's outcome is unknown is
// not sent again (the server would run it anew): the caller gets an
// *OutcomeUnknownError with the key and the last answer.
func ExampleOutcomeUnknownError() {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The first attempt is still running, and its key expires now.
		now := time.Now().UTC().Format(http.TimeFormat)
		w.Header().Set("Date", now)
		w.Header().Set("Idempotency-Key-Expires", now)
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusConflict)
	}))
	defer srv.Close()

	client := &http.Client{Transport: &httpretry.Transport{NewKey: func() string { return "order-42" }}}
	_, err := client.Post(srv.URL, "application/json", strings.NewReader(`{"item":"book"}`))
	var unknown *httpretry.OutcomeUnknownError
	if errors.As(err, &unknown) {
		fmt.Println("outcome unknown:", errors.Is(err, httpretry.ErrOutcomeUnknown))
		fmt.Println("key:", unknown.Key)
		fmt.Println("last answer:", unknown.Response.Status)
	}
	// Output:
	// outcome unknown: true
	// key: order-42
	// last answer: 409 Conflict
}
