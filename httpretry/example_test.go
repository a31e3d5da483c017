package httpretry_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

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
