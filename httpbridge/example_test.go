package httpbridge_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

// A route whose handler writes in the ledger's transaction: a retry with
// the same key gets the stored response, marked as a replay, and the order
// is made once. DATABASE_URL points at any Postgres (the tests set it to
// the local one).
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrations.New(pool, migrations.Config{Schema: "justonce"}).Up(ctx); err != nil {
		log.Fatal(err)
	}
	ledger, err := inbox.New(pool, inbox.Config{Schema: "justonce"})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, item text NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		log.Fatal(err)
	}
	createOrder := func(w http.ResponseWriter, r *http.Request) {
		tx := httpbridge.Tx(r.Context()) // the ledger's transaction
		var id int64
		err := tx.QueryRow(r.Context(), `INSERT INTO orders (item) VALUES ('book') RETURNING id`).Scan(&id)
		if err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable) // 5xx: rolled back, key free
			return
		}
		w.WriteHeader(http.StatusCreated) // stored with the ledger row, sent after COMMIT
		fmt.Fprintf(w, `{"order":%d}`, id)
	}
	orders := bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true, TTL: 72 * time.Hour})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", orders(http.HandlerFunc(createOrder)))

	// A client sends one operation twice with one key (httptest stands in
	// for your server).
	srv := httptest.NewServer(mux)
	defer srv.Close()
	key := uuid.NewString()
	var first []byte
	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true",
			"same body:", first == nil || bytes.Equal(body, first))
		first = body
	}
	// Output:
	// 201 replayed: false same body: true
	// 201 replayed: true same body: true
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
func ExampleConfig_principal() {
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
	rec, _ := ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: inbox.PrincipalKeyID("k-1", "bob")})
	fmt.Println("bob's row:", rec.Principal)
	// Output:
	// alice 201 {"order":1} replayed: false
	// bob 201 {"order":2} replayed: false
	// alice 201 {"order":1} replayed: true
	// bob's row: bob
}

// An observe-mode route lets every request through as if the bridge were
// absent, and says what enforcing would have done: here a request without
// a key on a route that requires one, a new key, its duplicate, and the
// key again with another body. All four ran.
func ExampleRouteConfig_observe() {
	pool, done := exampleDB()
	defer done()
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	var observed []string
	bridge, err := httpbridge.New(httpbridge.Config{
		Ledger: ledger,
		// metrics.NewBridgeCollector().Observer("http") counts these.
		OnObserve: func(route, would string) { observed = append(observed, route+": "+would) },
	})
	if err != nil {
		log.Fatal(err)
	}
	runs := 0
	h := bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true, Observe: true})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs++
			w.WriteHeader(http.StatusCreated)
		}))
	for _, c := range []struct{ key, body string }{{"", `{"n":1}`}, {"k-1", `{"n":1}`}, {"k-1", `{"n":1}`}, {"k-1", `{"n":2}`}} {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(c.body))
		req.Header.Set("Content-Type", "application/json")
		if c.key != "" {
			req.Header.Set("Idempotency-Key", c.key)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Print(rec.Code, " ")
	}
	fmt.Println("- runs:", runs)
	for _, o := range observed {
		fmt.Println(o)
	}
	// Output:
	// 201 201 201 201 - runs: 4
	// orders: would_refuse_missing_key
	// orders: would_run
	// orders: would_replay
	// orders: would_mismatch
}

// A route with keys of its own format, at most 128 bytes: a key the
// validator refuses is answered 400 invalid-key with its message.
func ExampleRouteConfig_keyValidator() {
	pool, done := exampleDB()
	defer done()
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		log.Fatal(err)
	}
	format := regexp.MustCompile(`^[\w.-]+:[\w.-]+:[\w.-]+:\d{13}$`)
	bookings := bridge.Route(httpbridge.RouteConfig{Scope: "bookings", MaxKeyLen: 128,
		KeyValidator: func(key string) error {
			if !format.MatchString(key) {
				return errors.New("the key must be {user}:{operation}:{resource}:{timestamp in ms}")
			}
			return nil
		}})
	h := bookings(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
	for _, key := range []string{"usr_abc123:booking.create:res_xyz:1704067200000", "booking-1"} {
		req := httptest.NewRequest(http.MethodPost, "/bookings", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		var p struct{ Detail string }
		_ = json.Unmarshal(rec.Body.Bytes(), &p)
		fmt.Println(strings.TrimSpace(fmt.Sprint(rec.Code, " ", p.Detail)))
	}
	// Output:
	// 201
	// 400 the key must be {user}:{operation}:{resource}:{timestamp in ms}
}

// A limit of two new keys per tenant and day: the third new key is
// refused (429 with Retry-After) and leaves nothing behind; a replay of a
// recorded key is never limited.
func ExampleRouteConfig_keyRate() {
	pool, done := exampleDB()
	defer done()
	ledger, err := inbox.New(pool, inbox.Config{}) // with Redis, the counts live there
	if err != nil {
		log.Fatal(err)
	}
	bridge, err := httpbridge.New(httpbridge.Config{
		Ledger: ledger,
		Tenant: func(r *http.Request) string { return r.Header.Get("X-Tenant") },
	})
	if err != nil {
		log.Fatal(err)
	}
	orders := bridge.Route(httpbridge.RouteConfig{Scope: "orders", KeyRate: &inbox.KeyRate{
		Limit:  func(tenant string) int64 { return 2 },
		Window: 24 * time.Hour,
	}})
	h := orders(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusCreated) }))
	send := func(key string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("X-Tenant", "acme")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	for _, key := range []string{"o-1", "o-2", "o-3"} {
		rec := send(key)
		fmt.Println(key, rec.Code, "Retry-After set:", rec.Header().Get("Retry-After") != "")
	}
	replay := send("o-1")
	fmt.Println("o-1 again:", replay.Code, "replayed:", replay.Header().Get("Idempotent-Replayed"))
	// Output:
	// o-1 201 Retry-After set: false
	// o-2 201 Retry-After set: false
	// o-3 429 Retry-After set: true
	// o-1 again: 201 replayed: true
}

// A route that keeps its keys for 30 days but their stored responses,
// which may hold personal data, for a short while only (here 200 ms): a
// retry after the response is gone does not run again; the route's
// StaleResponse sends the client to the order's current state, and
// without it (or when it has no answer) the client gets 422
// response-expired.
func ExampleRouteConfig_resultTTL() {
	pool, done := exampleDB()
	defer done()
	ledger, err := inbox.New(pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
	if err != nil {
		log.Fatal(err)
	}
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, _ := httpbridge.Key(r.Context()) // the order remembers its key
		var id int64
		if err := httpbridge.Tx(r.Context()).QueryRow(r.Context(),
			`INSERT INTO orders (body) VALUES ($1) RETURNING id`, key).Scan(&id); err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d,"card":"4242…"}`, id)
	})
	rc := httpbridge.RouteConfig{
		Scope:     "orders",
		TTL:       30 * 24 * time.Hour,
		ResultTTL: 200 * time.Millisecond,
		StaleResponse: func(w http.ResponseWriter, r *http.Request, info httpbridge.StaleInfo) bool {
			var id int64
			err := pool.QueryRow(r.Context(), `SELECT id FROM orders WHERE body = $1`, info.Key).Scan(&id)
			if err != nil {
				return false // no answer: 422 response-expired
			}
			w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
			w.WriteHeader(http.StatusSeeOther)
			return true
		},
	}
	h := bridge.Route(rc)(createOrder)
	send := func(key string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	fmt.Println(send("k-1").Code, send("k-1").Code)
	deadline := time.Now().Add(10 * time.Second)
	for send("k-1").Code == http.StatusCreated && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond) // the stored response's clock runs
	}
	late := send("k-1")
	fmt.Println(late.Code, late.Header().Get("Location"), late.Header().Get("Idempotent-Replayed"))
	if _, err := pool.Exec(context.Background(), `DELETE FROM orders`); err != nil { // the order is gone
		log.Fatal(err)
	}
	late = send("k-1")
	var p struct{ Type string }
	_ = json.Unmarshal(late.Body.Bytes(), &p)
	fmt.Println(late.Code, p.Type)
	// Output:
	// 201 201
	// 303 /orders/1 true
	// 422 https://justonce.dev/problems/response-expired
}
