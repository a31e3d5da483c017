package chibridge_test

import (
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"

	"github.com/go-chi/chi/v5"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/integrations/internal/itest"
)

// A chi route behind the bridge: the handler writes through the ledger's
// transaction; a retry with the same key gets the stored response, the same
// key with another body gets 422 problem+json.
func Example() {
	pool, done := itest.ExampleDB() // a Postgres schema with the ledger and an orders table
	defer done()
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		log.Fatal(err)
	}

	r := chi.NewRouter()
	idempotent := bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})
	r.With(idempotent).Post("/orders", func(w http.ResponseWriter, r *http.Request) {
		var in struct{ Item string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, "bad body", http.StatusBadRequest) // 4xx: stored like a success
			return
		}
		ctx := r.Context()
		var id int64
		err := httpbridge.Tx(ctx).QueryRow(ctx, `INSERT INTO orders (item) VALUES ($1) RETURNING id`, in.Item).Scan(&id)
		if err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable) // 5xx: rolled back, key free
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d,"item":%q}`, id, in.Item)
	})

	srv := httptest.NewServer(r)
	defer srv.Close()
	for _, body := range []string{`{"item":"book"}`, `{"item":"book"}`, `{"item":"pen"}`} {
		resp, err := itest.Post(srv.URL+"/orders", "order-key-1", body)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(resp)
	}
	// Output:
	// 201 {"order":1,"item":"book"}
	// 201 replayed {"order":1,"item":"book"}
	// 422 application/problem+json https://justonce.dev/problems/key-reused
}
