package httpbridge_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

// A route whose handler writes in the ledger's transaction: a retry with
// the same key gets the stored response, marked as a replay.
func Example() {
	pool, done := exampleDB()
	defer done()

	ledger, _ := inbox.New(pool, inbox.Config{})
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		panic(err)
	}
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var id int64
		// The order, the ledger row and the stored response commit together.
		err := httpbridge.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO orders (body) VALUES ($1) RETURNING id`, body).Scan(&id)
		if err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable) // 5xx: rolled back, key free
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, id)
	})

	mux := http.NewServeMux()
	orders := bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})
	mux.Handle("POST /orders", orders(createOrder))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for i := 0; i < 2; i++ {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, string(body), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	var n int
	_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&n)
	fmt.Println("orders:", n)
	// Output:
	// 201 {"order":1} replayed: false
	// 201 {"order":1} replayed: true
	// orders: 1
}

// A Kafka consumer and an HTTP route share the scope "payments": the event
// ran first, so the HTTP request with the same key does not run again and
// gets the documented default response.
func ExampleBridge_Route_sharedWithConsumer() {
	pool, done := exampleDB()
	defer done()
	ledger, _ := inbox.New(pool, inbox.Config{})
	bridge, _ := httpbridge.New(httpbridge.Config{Ledger: ledger})

	// What the consumer runtime does for event "evt-42" (consumer package).
	_, _ = ledger.Do(context.Background(), inbox.Request{
		Key: inbox.Key{Scope: "payments", ID: "evt-42"}, Source: inbox.Source("kafka"),
	}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO orders (body) VALUES ('paid')`)
		return inbox.Result{}, err
	})

	h := bridge.Route(httpbridge.RouteConfig{Scope: "payments"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		panic("not reached")
	}))
	req := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "evt-42")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	fmt.Println(rec.Code, rec.Header().Get("Idempotent-Replayed"), rec.Body.String())
	// Output:
	// 200 true {"status":"already_processed","source":"kafka"}
}

// Lease mode, for effects outside the database: the handler gets a fencing
// token instead of a transaction.
func ExampleFencingToken() {
	pool, done := exampleDB()
	defer done()
	ledger, _ := inbox.New(pool, inbox.Config{})
	bridge, _ := httpbridge.New(httpbridge.Config{Ledger: ledger})

	charge := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, _ := httpbridge.FencingToken(r.Context())
		// Call the provider with the token (or the key) so that it can
		// turn away a stale attempt.
		_ = token
		fmt.Println("charging; in a transaction:", httpbridge.Tx(r.Context()) != nil)
		w.WriteHeader(http.StatusCreated)
	})
	h := bridge.Route(httpbridge.RouteConfig{Scope: "charges", Lease: true})(charge)
	for i := 0; i < 2; i++ {
		req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(`{"amount":100}`))
		req.Header.Set("Idempotency-Key", "charge-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Println(rec.Code, "replayed:", rec.Header().Get("Idempotent-Replayed") == "true")
	}
	// Output:
	// charging; in a transaction: false
	// 201 replayed: false
	// 201 replayed: true
}

// A storage policy that keeps 5xx too (the client then gets the same 500
// on every retry) but never 4xx.
func ExampleDefaultStore() {
	rc := httpbridge.RouteConfig{
		Scope: "reports",
		Store: func(status int) bool { return status >= 500 || httpbridge.DefaultStore(status) && status < 400 },
	}
	fmt.Println(rc.Validate(), rc.Store(201), rc.Store(404), rc.Store(500))
	fmt.Println(httpbridge.DefaultStore(201), httpbridge.DefaultStore(409), httpbridge.DefaultStore(503))
	// Output:
	// <nil> true false true
	// true false false
}

// Keys are isolated per principal once the bridge knows the caller: bob
// sending alice's key runs a request of his own and never gets alice's
// response, while alice's retry is a replay.
func ExamplePrincipalKeyID() {
	pool, done := exampleDB()
	defer done()
	ledger, _ := inbox.New(pool, inbox.Config{})
	bridge, _ := httpbridge.New(httpbridge.Config{
		Ledger:    ledger,
		Principal: func(r *http.Request) string { return r.Header.Get("X-User") }, // from your auth middleware
	})
	h := bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var id int64
		_ = httpbridge.Tx(r.Context()).QueryRow(r.Context(), `INSERT INTO orders (body) VALUES ('x') RETURNING id`).Scan(&id)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, id)
	}))
	for _, user := range []string{"alice", "bob", "alice"} {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k-1")
		req.Header.Set("X-User", user)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Println(user, rec.Code, rec.Body.String(), "replayed:", rec.Header().Get("Idempotent-Replayed") == "true")
	}
	rec, _ := ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: httpbridge.PrincipalKeyID("k-1", "bob")})
	fmt.Println("bob's row:", rec.Principal)
	// Output:
	// alice 201 {"order":1} replayed: false
	// bob 201 {"order":2} replayed: false
	// alice 201 {"order":1} replayed: true
	// bob's row: bob
}
