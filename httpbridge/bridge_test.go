package httpbridge_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/inbox"
)

func TestReplayIsIdenticalToFirstResponse(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)

		first := post(h, "k-1", `{"item":"book","qty":1}`)
		require.Equal(t, http.StatusCreated, first.Code)
		require.False(t, first.replayed())
		require.Equal(t, "session=secret", first.Header.Get("Set-Cookie"), "the first response keeps its cookie")
		require.Equal(t, fmt.Sprint(len(first.Body)), first.Header.Get("Content-Length"))

		for i := 0; i < 3; i++ {
			again := post(h, "k-1", `{"item":"book","qty":1}`)
			require.True(t, again.replayed())
			sameResponse(t, first, again)
			require.Empty(t, again.Header.Values("Set-Cookie"), "credentials are never replayed")
		}
		require.EqualValues(t, 1, a.runs.Load())
		require.Equal(t, 1, b.orders(t))

		rec, err := b.ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: "k-1"})
		require.NoError(t, err)
		require.Equal(t, httpbridge.Source, rec.Source)
		require.Equal(t, http.StatusCreated, rec.Result.Code)
		require.NotContains(t, rec.Result.Header, "Set-Cookie", "credentials are never stored")
		require.Equal(t, string(first.Body), string(rec.Result.Body))
		if redisOn {
			out := b.ledger.Counters()
			require.NotZero(t, out.CacheHits, "replays come from the Redis cache")
		}
	})
}

func TestConcurrentRequestsWithOneKeyRunOnce(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		// One key's concurrency, not overload: the thousand requests wait
		// for a connection as long as they need (no 503 overloaded).
		b := setup(t, setupOpts{redis: redisOn, pg: []testsvc.PGOption{testsvc.MaxConns(16)},
			cfg: httpbridge.Config{AcquireWait: time.Minute}})
		const n = 1000
		var answered atomic.Int64
		gate := make(chan struct{})
		a := &app{}
		slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// Hold the key until half the others have been answered (409s),
			// so the test sees both in-flight answers and replays.
			select {
			case <-gate:
			case <-time.After(10 * time.Second):
			}
			a.ServeHTTP(w, r)
		})
		srv := httptest.NewServer(b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(slow))
		defer srv.Close()
		client := srv.Client()
		client.Transport.(*http.Transport).MaxIdleConnsPerHost = n

		var wg sync.WaitGroup
		var mu sync.Mutex
		var firsts, replays, conflicts int
		var bodies = map[string]int{}
		start := make(chan struct{})
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				r, err := send(t, client, context.Background(), srv.URL+"/orders", "same-key", `{"item":"pen"}`)
				if err != nil {
					t.Error(err)
					return
				}
				if answered.Add(1) == n/2 {
					close(gate)
				}
				mu.Lock()
				defer mu.Unlock()
				switch {
				case r.Code == http.StatusConflict:
					conflicts++
					require.NotEmpty(t, r.Header.Get("Retry-After"))
				case r.Code == http.StatusCreated && r.replayed():
					replays++
					bodies[string(r.Body)]++
				case r.Code == http.StatusCreated:
					firsts++
					bodies[string(r.Body)]++
				default:
					t.Errorf("unexpected %d: %s", r.Code, r.Body)
				}
			}()
		}
		close(start)
		wg.Wait()
		require.Equal(t, 1, firsts, "one request ran the handler")
		require.Equal(t, n, firsts+replays+conflicts)
		require.NotZero(t, conflicts)
		require.Len(t, bodies, 1, "every replay equals the first response")
		require.EqualValues(t, 1, a.runs.Load())
		require.Equal(t, 1, b.orders(t), "one effect")
		t.Logf("1 executed, %d replays, %d conflicts", replays, conflicts)
	})
}

func TestMismatchedBodyIs422ButReorderedJSONIsNot(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)

		first := post(h, "k", `{"item":"book","qty":1,"meta":{"b":[1,{"y":2,"x":1}],"a":12345678901234567890}}`)
		require.Equal(t, http.StatusCreated, first.Code)

		// Same JSON, keys reordered at every level, other whitespace.
		same := post(h, "k", "{ \"meta\" : {\"a\":12345678901234567890, \"b\":[1,{\"x\":1,\"y\":2}]},\n\"qty\":1, \"item\":\"book\" }")
		require.Equal(t, http.StatusCreated, same.Code)
		require.True(t, same.replayed())
		sameResponse(t, first, same)

		for _, body := range []string{
			`{"item":"book","qty":2,"meta":{"b":[1,{"y":2,"x":1}],"a":12345678901234567890}}`,
			`{"item":"book","qty":1,"meta":{"b":[1,{"y":2,"x":1}],"a":12345678901234567891}}`, // float64 would not see it
			`{"item":"book","qty":1,"meta":{"b":[{"y":2,"x":1},1],"a":12345678901234567890}}`, // array order matters
		} {
			r := post(h, "k", body)
			requireProblem(t, r, http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
			require.False(t, r.replayed())
		}
		// Another path or method is another request too.
		r := serve(h, http.MethodPatch, "/orders", `{"item":"book","qty":1}`, "Idempotency-Key", "k", "Content-Type", "application/json")
		requireProblem(t, r, http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
		r = serve(h, http.MethodPost, "/orders/other", `{"qty":1,"item":"book","meta":{"a":12345678901234567890,"b":[1,{"x":1,"y":2}]}}`, "Idempotency-Key", "k", "Content-Type", "application/json")
		requireProblem(t, r, http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)

		require.EqualValues(t, 1, a.runs.Load())
		require.Equal(t, 1, b.orders(t))
	})
}

func TestFormFieldsAreSorted(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
	form := func(body string) response {
		return serve(h, http.MethodPost, "/orders", body, "Idempotency-Key", "f", "Content-Type", "application/x-www-form-urlencoded")
	}
	require.Equal(t, http.StatusCreated, form("b=2&a=1&a=3").Code)
	require.True(t, form("a=1&b=2&a=3").replayed(), "fields sorted, values of one field keep their order")
	requireProblem(t, form("a=3&b=2&a=1"), http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
	// A raw body is compared as is.
	raw := func(body string) response {
		return serve(h, http.MethodPost, "/orders", body, "Idempotency-Key", "raw", "Content-Type", "text/plain")
	}
	require.Equal(t, http.StatusCreated, raw(`{"b":1,"a":2}`).Code)
	requireProblem(t, raw(`{"a":2,"b":1}`), http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
}

func TestServerErrorRollsBackAndRetryRunsAgain(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
		failing := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, err := httpbridge.Tx(r.Context()).Exec(r.Context(), `INSERT INTO orders (body) VALUES ('doomed')`)
			require.NoError(t, err)
			http.Error(w, "payment provider down", http.StatusBadGateway)
		}))

		r := post(failing, "k5", `{"x":1}`)
		require.Equal(t, http.StatusBadGateway, r.Code)
		require.Equal(t, "payment provider down\n", string(r.Body), "the client gets the handler's 5xx")
		require.False(t, r.replayed())
		require.Zero(t, b.orders(t), "the handler's write was rolled back")
		_, err := b.ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: "k5"})
		require.ErrorIs(t, err, inbox.ErrNotFound, "no ledger row is left")

		r = post(h, "k5", `{"x":1}`)
		require.Equal(t, http.StatusCreated, r.Code, "the retry runs")
		require.False(t, r.replayed())
		require.Equal(t, 1, b.orders(t))
		require.True(t, post(h, "k5", `{"x":1}`).replayed())
	})
}

func TestPanicRollsBackReleasesAndIsReraised(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		var panics atomic.Bool
		panics.Store(true)
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			a.ServeHTTP(w, r)
			if panics.Load() {
				panic("boom")
			}
		}))
		require.PanicsWithValue(t, "boom", func() { post(h, "kp", `{}`) })
		require.Zero(t, b.orders(t))
		panics.Store(false)
		// With Redis, this also shows the Redis lock was released.
		r := post(h, "kp", `{}`)
		require.Equal(t, http.StatusCreated, r.Code, "body: %s", r.Body)
		require.Equal(t, 1, b.orders(t))

		// Through a real server the panic aborts the connection and the
		// retry runs.
		panics.Store(true)
		srv := httptest.NewUnstartedServer(h)
		srv.Config.ErrorLog = quietLog()
		srv.Start()
		defer srv.Close()
		_, err := send(t, srv.Client(), context.Background(), srv.URL+"/orders", "kp2", `{}`)
		require.Error(t, err)
		panics.Store(false)
		r2, err := send(t, srv.Client(), context.Background(), srv.URL+"/orders", "kp2", `{}`)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, r2.Code)
		require.Equal(t, 2, b.orders(t))
	})
}

func TestUnstoredClientErrorRollsBackButReachesClient(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	var runs atomic.Int64
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		_, err := httpbridge.Tx(r.Context()).Exec(r.Context(), `INSERT INTO orders (body) VALUES ('x')`)
		require.NoError(t, err)
		if n == 1 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusConflict)
			_, _ = w.Write([]byte(`{"error":"seat taken"}`))
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	r := post(h, "k409", `{}`)
	require.Equal(t, http.StatusConflict, r.Code)
	require.Equal(t, `{"error":"seat taken"}`, string(r.Body), "the handler's 409 is passed on")
	require.Equal(t, "application/json", r.Header.Get("Content-Type"))
	require.Zero(t, b.orders(t), "a status that is not stored rolls back")
	_, err := b.ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: "k409"})
	require.ErrorIs(t, err, inbox.ErrNotFound)

	r = post(h, "k409", `{}`)
	require.Equal(t, http.StatusCreated, r.Code, "the key was free")
	require.Equal(t, 1, b.orders(t))
}

func TestClientErrorIsStoredAndReplayed(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	var runs atomic.Int64
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = w.Write([]byte(`{"title":"qty must be positive"}`))
	}))
	first := post(h, "k400", `{"qty":-1}`)
	require.Equal(t, http.StatusBadRequest, first.Code)
	again := post(h, "k400", `{"qty":-1}`)
	require.True(t, again.replayed())
	sameResponse(t, first, again)
	require.EqualValues(t, 1, runs.Load())
}

func TestCustomStorePolicy(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	var runs atomic.Int64
	h := b.bridge.Route(httpbridge.RouteConfig{
		Scope: "orders",
		// Stripe-like: keep 5xx too, but not 4xx.
		Store: func(code int) bool { return code >= 500 || code < 400 },
	})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if runs.Add(1) == 1 {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	require.Equal(t, http.StatusInternalServerError, post(h, "s", `{}`).Code)
	r := post(h, "s", `{}`)
	require.Equal(t, http.StatusInternalServerError, r.Code)
	require.True(t, r.replayed())
	require.EqualValues(t, 1, runs.Load())

	require.True(t, httpbridge.DefaultStore(201))
	require.True(t, httpbridge.DefaultStore(303))
	require.True(t, httpbridge.DefaultStore(404))
	for _, c := range []int{100, 408, 409, 425, 429, 500, 503} {
		require.False(t, httpbridge.DefaultStore(c), c)
	}
}

func TestTenantKeysNeverCross(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
		ra := post(h, "shared", `{"who":"a"}`, "X-Tenant", "tenant-a")
		rb := post(h, "shared", `{"who":"b"}`, "X-Tenant", "tenant-b")
		require.Equal(t, http.StatusCreated, ra.Code)
		require.Equal(t, http.StatusCreated, rb.Code, "B's request is new, not a mismatch with A's")
		require.False(t, rb.replayed())
		require.NotEqual(t, string(ra.Body), string(rb.Body))

		// Same body as A's, under B: still B's own response.
		rb2 := post(h, "shared", `{"who":"b"}`, "X-Tenant", "tenant-b")
		require.True(t, rb2.replayed())
		require.Equal(t, string(rb.Body), string(rb2.Body))
		requireProblem(t, post(h, "shared", `{"who":"a"}`, "X-Tenant", "tenant-b"), http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
		ra2 := post(h, "shared", `{"who":"a"}`, "X-Tenant", "tenant-a")
		require.Equal(t, string(ra.Body), string(ra2.Body))
		require.Equal(t, 2, b.orders(t))
	})
}

// consume simulates a Kafka consumer on the same ledger and scope.
func consume(t *testing.T, b *bundle, key string, res inbox.Result) inbox.Outcome {
	t.Helper()
	out, err := b.ledger.Do(context.Background(), inbox.Request{
		Key:    inbox.Key{Scope: "orders", ID: key},
		Source: inbox.Source("kafka"),
	}, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		_, err := tx.Exec(ctx, `INSERT INTO orders (body) VALUES ('from kafka')`)
		return res, err
	})
	require.NoError(t, err)
	return out
}

func TestHTTPThenConsumerRunsOnce(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
		require.Equal(t, http.StatusCreated, post(h, "evt-1", `{"a":1}`).Code)
		out := consume(t, b, "evt-1", inbox.Result{})
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.Equal(t, httpbridge.Source, out.Record.Source)
		require.Equal(t, 1, b.orders(t))
	})
}

func TestConsumerThenHTTPRunsOnce(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
		require.Equal(t, inbox.Executed, consume(t, b, "evt-2", inbox.Result{}).Disposition)

		for i := 0; i < 2; i++ { // from Postgres, then (with Redis) from the cache
			r := post(h, "evt-2", `{"a":1}`)
			require.Equal(t, http.StatusOK, r.Code)
			require.True(t, r.replayed())
			require.Equal(t, "application/json", r.Header.Get("Content-Type"))
			require.JSONEq(t, `{"status":"already_processed","source":"kafka"}`, string(r.Body))
		}
		require.Zero(t, a.runs.Load())
		require.Equal(t, 1, b.orders(t))

		// A consumer that recorded an HTTP-shaped result has it replayed.
		consume(t, b, "evt-3", inbox.Result{Code: 202, Header: map[string][]string{"Content-Type": {"text/plain"}}, Body: []byte("queued")})
		r := post(h, "evt-3", `{}`)
		require.Equal(t, 202, r.Code)
		require.Equal(t, "queued", string(r.Body))
		require.True(t, r.replayed())
	})
}

func TestKeyDeadLetteredByConsumer(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
		ok, err := b.ledger.RecordFailure(context.Background(), inbox.Request{
			Key: inbox.Key{Scope: "orders", ID: "dead"}, Source: inbox.Source("kafka"),
		}, 5, errors.New("poison: secret internal detail"))
		require.NoError(t, err)
		require.True(t, ok)
		r := post(h, "dead", `{}`)
		p := requireProblem(t, r, http.StatusUnprocessableEntity, httpbridge.ProblemKeyFailed)
		require.True(t, r.replayed())
		require.Contains(t, p.Detail, "kafka")
		require.NotContains(t, p.Detail, "secret", "the consumer's error text is not disclosed")
		require.Zero(t, a.runs.Load())
	})
}

func TestClientDisconnectLosesNothing(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		started := make(chan struct{})
		release := make(chan struct{})
		unblock := closer(t, release)
		var outer atomic.Pointer[context.Context]
		a := &app{}
		slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if a.runs.Load() == 0 {
				close(started)
				<-release
			}
			a.ServeHTTP(w, r) // uses the transaction after the client left
		})
		mw := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(slow)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			ctx := r.Context()
			outer.CompareAndSwap(nil, &ctx)
			mw.ServeHTTP(w, r)
		}))
		defer srv.Close()
		defer unblock() // before srv.Close, which waits for the handler
		c := srv.Client()

		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		ended := make(chan response, 1)
		go func() {
			r, err := send(t, c, ctx, srv.URL+"/orders", "gone", `{"item":"lamp"}`)
			if err == nil {
				ended <- r
			}
			errc <- err
		}()
		await(t, started, "the handler starts", ended)
		cancel()
		require.ErrorIs(t, <-errc, context.Canceled)
		testsvc.Eventually(t, 5*time.Second, func() bool {
			p := outer.Load()
			return p != nil && (*p).Err() != nil
		}, "the server sees the client gone")

		// While the handler still runs, a retry is told to wait.
		r, err := send(t, c, context.Background(), srv.URL+"/orders", "gone", `{"item":"lamp"}`)
		require.NoError(t, err)
		requireProblem(t, r, http.StatusConflict, httpbridge.ProblemInProgress)

		unblock()
		testsvc.Eventually(t, 5*time.Second, func() bool {
			_, err := b.ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: "gone"})
			return err == nil
		}, "the abandoned request completes and is recorded")
		require.Equal(t, 1, b.orders(t))

		r, err = send(t, c, context.Background(), srv.URL+"/orders", "gone", `{"item":"lamp"}`)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, r.Code)
		require.True(t, r.replayed(), "the retry gets the response the client missed")
		require.Contains(t, string(r.Body), `lamp`)
		require.EqualValues(t, 1, a.runs.Load())
	})
}

func TestInFlightIs409WithRetryAfter(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn, cfg: httpbridge.Config{RetryAfter: 1500 * time.Millisecond}})
		started, release := make(chan struct{}), make(chan struct{})
		unblock := closer(t, release)
		a := &app{}
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(started)
			<-release
			a.ServeHTTP(w, r)
		}))
		done := make(chan response, 1)
		go func() { done <- post(h, "busy", `{}`) }()
		await(t, started, "the handler starts", done)
		r := post(h, "busy", `{}`)
		requireProblem(t, r, http.StatusConflict, httpbridge.ProblemInProgress)
		require.Equal(t, "2", r.Header.Get("Retry-After"), "rounded up to whole seconds")
		unblock()
		require.Equal(t, http.StatusCreated, (<-done).Code)
	})
}

func TestLockWaitTurnsConflictIntoReplay(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	started, release := make(chan struct{}), make(chan struct{})
	unblock := closer(t, release)
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", LockWait: 5 * time.Second})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.runs.Load() == 0 {
			close(started)
			<-release
		}
		a.ServeHTTP(w, r)
	}))
	done := make(chan response, 1)
	go func() { done <- post(h, "wait", `{}`) }()
	await(t, started, "the handler starts", done)
	waiting := make(chan response)
	go func() { waiting <- post(h, "wait", `{}`) }()
	unblock()
	first, second := <-done, <-waiting
	require.Equal(t, http.StatusCreated, first.Code)
	require.True(t, second.replayed(), "the duplicate waited for the replay: %d %s", second.Code, second.Body)
	sameResponse(t, first, second)
}

func TestKeyHeaderRules(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
	long := strings.Repeat("k", 256)
	for name, hdr := range map[string][]string{
		"list":             {"Idempotency-Key", `"a", "b"`},
		"bare list":        {"Idempotency-Key", `a,b`},
		"repeated":         {"Idempotency-Key", "a", "Idempotency-Key", "a"},
		"empty string":     {"Idempotency-Key", `""`},
		"blank":            {"Idempotency-Key", `  `},
		"too long":         {"Idempotency-Key", long},
		"non-printable":    {"Idempotency-Key", "ab\x01c"},
		"non-ascii":        {"Idempotency-Key", "caf\xc3\xa9"},
		"quoted non-ascii": {"Idempotency-Key", "\"caf\xc3\xa9\""},
		"unterminated":     {"Idempotency-Key", `"abc`},
		"parameters":       {"Idempotency-Key", `"abc";v=1`},
		"bad escape":       {"Idempotency-Key", `"a\b"`},
		"inner space":      {"Idempotency-Key", `a b`},
		"conflicting":      {"Idempotency-Key", "a", "X-Idempotency-Key", "b"},
	} {
		r := serve(h, http.MethodPost, "/orders", `{}`, hdr...)
		p := requireProblem(t, r, http.StatusBadRequest, httpbridge.ProblemInvalidKey)
		require.NotEmpty(t, p.Detail, name)
	}
	require.Zero(t, a.runs.Load())

	// Accepted forms: an sf-string and a bare value name the same key.
	ok := serve(h, http.MethodPost, "/orders", `{}`, "Idempotency-Key", `"abc-1"`)
	require.Equal(t, http.StatusCreated, ok.Code)
	require.True(t, serve(h, http.MethodPost, "/orders", `{}`, "Idempotency-Key", `abc-1`).replayed())
	require.True(t, serve(h, http.MethodPost, "/orders", `{}`, "X-Idempotency-Key", `abc-1`).replayed(), "the X- name is accepted")
	require.True(t, serve(h, http.MethodPost, "/orders", `{}`, "Idempotency-Key", "abc-1", "X-Idempotency-Key", `"abc-1"`).replayed())
	require.Equal(t, http.StatusCreated, serve(h, http.MethodPost, "/orders", `{}`, "Idempotency-Key", `"with \"quotes\" and spaces"`).Code)
	require.Equal(t, http.StatusCreated, serve(h, http.MethodPost, "/orders", `{}`, "Idempotency-Key", strings.Repeat("k", 255)).Code)
	require.Equal(t, http.StatusCreated, serve(h, http.MethodPost, "/orders", `{}`, "Idempotency-Key", "usr_abc123:booking.create:res_xyz:1704067200000").Code)
}

func TestMissingKey(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	a := &app{}
	required := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})(a)
	p := requireProblem(t, serve(required, http.MethodPost, "/orders", `{}`), http.StatusBadRequest, httpbridge.ProblemMissingKey)
	require.Contains(t, p.Detail, "Idempotency-Key")
	require.Zero(t, a.runs.Load())

	// Optional: the request passes through, still in a transaction.
	optional := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
	r1 := serve(optional, http.MethodPost, "/orders", `{}`)
	r2 := serve(optional, http.MethodPost, "/orders", `{}`)
	require.Equal(t, http.StatusCreated, r1.Code)
	require.Equal(t, http.StatusCreated, r2.Code)
	require.Equal(t, 2, b.orders(t), "no key, no dedupe")
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_events`))

	// Keyless 5xx rolls back like a keyed one.
	failing := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := httpbridge.Tx(r.Context())
		_, err := tx.Exec(r.Context(), `INSERT INTO orders (body) VALUES ('x')`)
		require.NoError(t, err)
		require.ErrorIs(t, tx.Commit(r.Context()), inbox.ErrTxOwned)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	require.Equal(t, http.StatusServiceUnavailable, serve(failing, http.MethodPost, "/orders", `{}`).Code)
	require.Equal(t, 2, b.orders(t))
}

func TestMethods(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	var sawTx atomic.Bool
	probe := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sawTx.Store(httpbridge.Tx(r.Context()) != nil)
		w.WriteHeader(http.StatusOK)
	})
	def := b.bridge.Route(httpbridge.RouteConfig{Scope: "m"})(probe)
	for _, m := range []string{http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodPut, http.MethodDelete} {
		r := serve(def, m, "/x", "", "Idempotency-Key", "a,b") // would be a 400 if covered
		require.Equal(t, http.StatusOK, r.Code, m)
		require.False(t, sawTx.Load(), m)
	}
	for _, m := range []string{http.MethodPost, http.MethodPatch} {
		require.Equal(t, http.StatusBadRequest, serve(def, m, "/x", "", "Idempotency-Key", "a,b").Code, m)
	}
	put := b.bridge.Route(httpbridge.RouteConfig{Scope: "m", Methods: []string{http.MethodPut, http.MethodDelete}})(probe)
	require.Equal(t, http.StatusOK, serve(put, http.MethodPut, "/x", "", "Idempotency-Key", "p").Code)
	require.True(t, sawTx.Load())
	require.True(t, serve(put, http.MethodPut, "/x", "", "Idempotency-Key", "p").replayed())
	require.False(t, serve(put, http.MethodPost, "/x", "", "Idempotency-Key", "p").replayed())

	require.Panics(t, func() { b.bridge.Route(httpbridge.RouteConfig{Scope: "m", Methods: []string{http.MethodGet}}) })
}

func TestUUIDKeyFormat(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "leads", KeyFormat: httpbridge.KeyUUIDv4})(&app{})
	requireProblem(t, post(h, "not-a-uuid", `{}`), http.StatusBadRequest, httpbridge.ProblemInvalidKey)
	requireProblem(t, post(h, "550e8400-e29b-11d4-a716-446655440000", `{}`), http.StatusBadRequest, httpbridge.ProblemInvalidKey) // v1
	require.Equal(t, http.StatusCreated, post(h, "550E8400-E29B-41D4-A716-446655440000", `{}`).Code)
	require.True(t, post(h, "550e8400-e29b-41d4-a716-446655440000", `{}`).replayed(), "UUIDs compare case-insensitively")

	anyUUID := b.bridge.Route(httpbridge.RouteConfig{Scope: "leads", KeyFormat: httpbridge.KeyUUID})(&app{})
	require.Equal(t, http.StatusCreated, post(anyUUID, "0190d3a0-7b5c-7c8e-9f00-0123456789ab", `{}`).Code) // v7
}

func TestBodyLimitAndRestoredBody(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", MaxBodyBytes: 32})(a)
	p := requireProblem(t, post(h, "big", strings.Repeat("x", 33)), http.StatusRequestEntityTooLarge, httpbridge.ProblemBodyTooLarge)
	require.Contains(t, p.Detail, "32")
	// Without Content-Length too (chunked upload).
	req := httptest.NewRequest(http.MethodPost, "/orders", struct{ *strings.Reader }{strings.NewReader(strings.Repeat("y", 100))})
	req.ContentLength = -1
	req.Header.Set("Idempotency-Key", "big2")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	require.Equal(t, http.StatusRequestEntityTooLarge, rec.Code)
	require.Zero(t, a.runs.Load())

	body := `{"exactly":"32 bytes long....."}`
	require.Len(t, body, 32)
	r := post(h, "fits", body)
	require.Equal(t, http.StatusCreated, r.Code)
	require.Contains(t, string(r.Body), `exactly`, "the handler read the whole body")
	var stored string
	require.NoError(t, b.pg.Pool.QueryRow(context.Background(), `SELECT body FROM orders`).Scan(&stored))
	require.Equal(t, body, stored)
}

func TestResponseOverStoreCap(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	big := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tx := httpbridge.Tx(r.Context()); tx != nil {
			_, err := tx.Exec(r.Context(), `INSERT INTO orders (body) VALUES ('big')`)
			require.NoError(t, err)
		}
		w.WriteHeader(http.StatusCreated)
		for i := 0; i < 10; i++ {
			_, _ = w.Write([]byte(strings.Repeat("z", 10)))
		}
	})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", MaxResponseBytes: 64})(big)
	p := requireProblem(t, post(h, "huge", `{}`), http.StatusInternalServerError, httpbridge.ProblemResponseTooLarge)
	require.Contains(t, p.Detail, "100 bytes")
	require.Zero(t, b.orders(t), "rolled back: nothing happened")
	_, err := b.ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: "huge"})
	require.ErrorIs(t, err, inbox.ErrNotFound, "the key is free")

	// Lease mode: the effect cannot be undone, so the key is marked failed.
	lease := b.bridge.Route(httpbridge.RouteConfig{Scope: "payments", Lease: true, MaxResponseBytes: 64})(big)
	requireProblem(t, post(lease, "huge", `{}`), http.StatusInternalServerError, httpbridge.ProblemResponseTooLarge)
	r := post(lease, "huge", `{}`)
	requireProblem(t, r, http.StatusUnprocessableEntity, httpbridge.ProblemKeyFailed)
	require.True(t, r.replayed())
}

func TestDenyHeadersAndLegacyReplayHeader(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{cfg: httpbridge.Config{
		DenyHeaders:        []string{"x-internal-token"},
		LegacyReplayHeader: "X-Idempotency-Replay",
	}})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Internal-Token", "t0ps3cret")
		w.Header().Set("Authorization", "Bearer abc")
		w.Header().Add("Set-Cookie", "a=1")
		w.Header().Add("Set-Cookie", "b=2")
		w.Header().Add("X-Multi", "1")
		w.Header().Add("X-Multi", "2")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte("<html>ok</html>")) // no Content-Type: sniffed once, stored
	}))
	first := post(h, "d", `{}`)
	require.Equal(t, "t0ps3cret", first.Header.Get("X-Internal-Token"))
	require.Len(t, first.Header.Values("Set-Cookie"), 2)
	require.Equal(t, "text/html; charset=utf-8", first.Header.Get("Content-Type"))

	again := post(h, "d", `{}`)
	require.Equal(t, "true", again.Header.Get("Idempotent-Replayed"))
	require.Equal(t, "true", again.Header.Get("X-Idempotency-Replay"))
	for _, k := range []string{"X-Internal-Token", "Authorization", "Set-Cookie"} {
		require.Empty(t, again.Header.Values(k), k)
	}
	require.Equal(t, []string{"1", "2"}, again.Header.Values("X-Multi"))
	require.Equal(t, "text/html; charset=utf-8", again.Header.Get("Content-Type"))
	require.Equal(t, "<html>ok</html>", string(again.Body))

	var raw string
	require.NoError(t, b.pg.Pool.QueryRow(context.Background(),
		`SELECT response_headers::text FROM processed_events WHERE event_id = 'd'`).Scan(&raw))
	require.NotContains(t, raw, "t0ps3cret")
	require.NotContains(t, raw, "Bearer")
	require.NotContains(t, raw, "a=1")
}

func TestMismatchNewRequestPolicy(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "leads", Mismatch: httpbridge.MismatchNewRequest})(a)
	r1 := post(h, "lead", `{"name":"Test"}`)
	r2 := post(h, "lead", `{"name":"Test2"}`)
	require.Equal(t, http.StatusCreated, r1.Code)
	require.Equal(t, http.StatusCreated, r2.Code, "another body is a new request")
	require.False(t, r2.replayed())
	r3 := post(h, "lead", `{ "name" : "Test" }`)
	require.True(t, r3.replayed())
	require.Equal(t, string(r1.Body), string(r3.Body))
	require.Equal(t, 2, b.orders(t))
	// The longest key still fits the ledger once suffixed.
	require.Equal(t, http.StatusCreated, post(h, strings.Repeat("k", 238), `{}`).Code)
	requireProblem(t, post(h, strings.Repeat("k", 239), `{}`), http.StatusBadRequest, httpbridge.ProblemInvalidKey)
}

func TestLiveKeyQuota(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", MaxLiveKeys: func(tenant string) int64 {
		if tenant == "big" {
			return 0 // unlimited
		}
		return 2
	}})(a)
	require.Equal(t, http.StatusCreated, post(h, "q1", `{}`, "X-Tenant", "small").Code)
	require.Equal(t, http.StatusCreated, post(h, "q2", `{}`, "X-Tenant", "small").Code)
	p := requireProblem(t, post(h, "q3", `{}`, "X-Tenant", "small"), http.StatusTooManyRequests, httpbridge.ProblemQuotaExceeded)
	require.Contains(t, p.Detail, "2")
	require.True(t, post(h, "q1", `{}`, "X-Tenant", "small").replayed(), "replays are still served")
	require.Equal(t, http.StatusCreated, post(h, "q3", `{}`, "X-Tenant", "other").Code, "the quota is per tenant")
	for i := 0; i < 3; i++ {
		require.Equal(t, http.StatusCreated, post(h, fmt.Sprint("b", i), `{}`, "X-Tenant", "big").Code)
	}
	require.EqualValues(t, 6, a.runs.Load())
}

func TestStoreUnavailableIs503(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
	require.Equal(t, http.StatusCreated, post(h, "before", `{}`).Code)

	// A ledger on a database that is not there.
	down := deadLedger(t)
	db, err := httpbridge.New(httpbridge.Config{Ledger: down})
	require.NoError(t, err)
	dh := db.Route(httpbridge.RouteConfig{Scope: "orders"})(a)
	r := post(dh, "k", `{}`)
	requireProblem(t, r, http.StatusServiceUnavailable, httpbridge.ProblemStoreUnavailable)
	require.Equal(t, "1", r.Header.Get("Retry-After"))
	requireProblem(t, serve(dh, http.MethodPost, "/orders", `{}`), http.StatusServiceUnavailable, httpbridge.ProblemStoreUnavailable)
	require.EqualValues(t, 1, a.runs.Load(), "the handler never ran without the store")
}

func TestRedisDownFallsBackToPostgres(t *testing.T) {
	t.Parallel()
	rp := testsvc.StartRedis(t)
	client := testsvc.NewRedisClient(rp.Addr)
	t.Cleanup(func() { _ = client.Close() })
	b := setup(t, setupOpts{redisCfg: &inbox.RedisConfig{Client: client, Prefix: testsvc.Unique("t") + ":"}})
	a := &app{}
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(a)

	first := post(h, "r1", `{}`)
	require.Equal(t, http.StatusCreated, first.Code)
	rp.Stop(t)
	again := post(h, "r1", `{}`)
	require.True(t, again.replayed(), "replayed from Postgres while Redis is down")
	sameResponse(t, first, again)
	require.Equal(t, http.StatusCreated, post(h, "r2", `{}`).Code, "new keys still run, deduped by Postgres")
	require.True(t, post(h, "r2", `{}`).replayed())
	require.NotZero(t, b.ledger.Counters().RedisFallbacks)

	rp.Start(t)
	testsvc.Eventually(t, 5*time.Second, func() bool { return post(h, "r2", `{}`).replayed() }, "replays after Redis is back")
	require.EqualValues(t, 2, a.runs.Load())
	require.Equal(t, 2, b.orders(t))
}

func TestLeaseMode(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		b := setup(t, setupOpts{redis: redisOn})
		var calls atomic.Int64
		var fail atomic.Bool
		var tokens sync.Map
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "payments", Lease: true, LeaseDuration: 3 * time.Second})(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				calls.Add(1)
				require.Nil(t, httpbridge.Tx(r.Context()), "no transaction in lease mode")
				tok, ok := httpbridge.FencingToken(r.Context())
				require.True(t, ok)
				tokens.Store(tok, true)
				key, ok := httpbridge.Key(r.Context())
				require.True(t, ok)
				require.Equal(t, "pay", key)
				if fail.Load() {
					w.WriteHeader(http.StatusBadGateway)
					return
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusCreated)
				fmt.Fprintf(w, `{"charged":true,"token":%d}`, tok)
			}))
		fail.Store(true)
		require.Equal(t, http.StatusBadGateway, post(h, "pay", `{"amount":5}`).Code)
		fail.Store(false)
		first := post(h, "pay", `{"amount":5}`)
		require.Equal(t, http.StatusCreated, first.Code, "a 5xx released the lease")
		again := post(h, "pay", `{"amount":5}`)
		require.True(t, again.replayed())
		sameResponse(t, first, again)
		requireProblem(t, post(h, "pay", `{"amount":6}`), http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
		require.EqualValues(t, 2, calls.Load())
		n := 0
		tokens.Range(func(any, any) bool { n++; return true })
		require.Equal(t, 2, n, "each claim has its own fencing token")

		// Keyless requests pass through, without a token.
		_, ok := httpbridge.FencingToken(context.Background())
		require.False(t, ok)
	})
}

func TestEncryptedBodiesAndKeyRotation(t *testing.T) {
	t.Parallel()
	stores(t, func(t *testing.T, redisOn bool) {
		k1, k2 := []byte(strings.Repeat("1", 32)), []byte(strings.Repeat("2", 16))
		b := setup(t, setupOpts{redis: redisOn, cfg: httpbridge.Config{
			Encryption: &httpbridge.Encryption{Keys: map[string][]byte{"k1": k1}, Current: "k1"},
		}})
		h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
		first := post(h, "enc", `{"card":"4242"}`)
		require.Equal(t, http.StatusCreated, first.Code)
		var stored []byte
		require.NoError(t, b.pg.Pool.QueryRow(context.Background(),
			`SELECT response_body FROM processed_events WHERE event_id = 'enc'`).Scan(&stored))
		require.NotContains(t, string(stored), "4242", "the body is encrypted at rest")
		if b.redis != nil {
			keys, err := b.redis.Keys(context.Background(), "*enc*").Result()
			require.NoError(t, err)
			for _, k := range keys {
				v, _ := b.redis.Get(context.Background(), k).Result()
				require.NotContains(t, v, "4242", "and in the Redis cache")
			}
		}
		again := post(h, "enc", `{"card":"4242"}`)
		require.True(t, again.replayed())
		sameResponse(t, first, again)
		require.Empty(t, again.Header.Get("Justonce-Body-Key"), "internal header is not replayed")

		// Rotation: k2 encrypts new bodies, k1 still reads old ones.
		rotated, err := httpbridge.New(httpbridge.Config{Ledger: b.ledger,
			Encryption: &httpbridge.Encryption{Keys: map[string][]byte{"k1": k1, "k2": k2}, Current: "k2"}})
		require.NoError(t, err)
		rh := rotated.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
		sameResponse(t, first, post(rh, "enc", `{"card":"4242"}`))
		second := post(rh, "enc2", `{"card":"1111"}`)
		require.Equal(t, http.StatusCreated, second.Code)
		sameResponse(t, second, post(rh, "enc2", `{"card":"1111"}`))

		// k1 retired: its rows cannot be replayed, and are not served raw.
		retired, err := httpbridge.New(httpbridge.Config{Ledger: b.ledger,
			Encryption: &httpbridge.Encryption{Keys: map[string][]byte{"k2": k2}, Current: "k2"}})
		require.NoError(t, err)
		th := retired.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
		requireProblem(t, post(th, "enc", `{"card":"4242"}`), http.StatusInternalServerError, httpbridge.ProblemReplayUnavailable)
		sameResponse(t, second, post(th, "enc2", `{"card":"1111"}`))
	})
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	for name, cfg := range map[string]httpbridge.Config{
		"no ledger":        {},
		"bad header":       {Ledger: b.ledger, Header: "Bad Header"},
		"bad deny":         {Ledger: b.ledger, DenyHeaders: []string{"a:b"}},
		"key too long":     {Ledger: b.ledger, MaxKeyLen: 256},
		"negative":         {Ledger: b.ledger, RetryAfter: -1},
		"no current key":   {Ledger: b.ledger, Encryption: &httpbridge.Encryption{Keys: map[string][]byte{"a": make([]byte, 32)}, Current: "b"}},
		"bad aes key size": {Ledger: b.ledger, Encryption: &httpbridge.Encryption{Keys: map[string][]byte{"a": make([]byte, 10)}, Current: "a"}},
	} {
		require.ErrorIs(t, cfg.Validate(), inbox.ErrConfig, name)
		_, err := httpbridge.New(cfg)
		require.ErrorIs(t, err, inbox.ErrConfig, name)
	}
	require.NoError(t, httpbridge.Config{Ledger: b.ledger}.Validate())

	for name, rc := range map[string]httpbridge.RouteConfig{
		"no scope":      {},
		"GET":           {Scope: "s", Methods: []string{"GET"}},
		"bad format":    {Scope: "s", KeyFormat: 9},
		"negative ttl":  {Scope: "s", TTL: -time.Second},
		"negative wait": {Scope: "s", LockWait: -time.Second},
		"lease dur":     {Scope: "s", LeaseDuration: time.Second},
		"bad fp hdr":    {Scope: "s", FingerprintHeaders: []string{"a b"}},
	} {
		require.ErrorIs(t, rc.Validate(), inbox.ErrConfig, name)
		require.Panics(t, func() { b.bridge.Route(rc) }, name)
	}
	require.NoError(t, httpbridge.RouteConfig{Scope: "s"}.Validate())
}

func TestFingerprintHeadersAndTTL(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders", TTL: 72 * time.Hour, FingerprintHeaders: []string{"Api-Version"}})(&app{})
	require.Equal(t, http.StatusCreated, post(h, "v", `{}`, "Api-Version", "1").Code)
	require.True(t, post(h, "v", `{}`, "Api-Version", "1").replayed())
	requireProblem(t, post(h, "v", `{}`, "Api-Version", "2"), http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
	rec, err := b.ledger.Lookup(context.Background(), inbox.Key{Scope: "orders", ID: "v"})
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(72*time.Hour), rec.ExpiresAt, time.Minute)
}

func TestLogsMaskKeys(t *testing.T) {
	t.Parallel()
	var buf testsvc.LogBuffer
	logger := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	b := setup(t, setupOpts{logger: logger})
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
	const key = "550e8400-e29b-41d4-a716-446655440000"
	require.Equal(t, http.StatusCreated, post(h, key, `{"a":1}`).Code)
	require.True(t, post(h, key, `{"a":1}`).replayed())
	requireProblem(t, post(h, key, `{"a":2}`), http.StatusUnprocessableEntity, httpbridge.ProblemKeyReused)
	out := buf.String()
	require.Contains(t, out, "550e****0000")
	require.NotContains(t, out, key)
	require.NotContains(t, out, "e29b")
}

func TestKeyInContext(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	var got atomic.Pointer[string]
	h := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k, ok := httpbridge.Key(r.Context())
		if !ok {
			k = "<none>"
		}
		got.Store(&k)
	}))
	serve(h, http.MethodPost, "/orders", `{}`, "Idempotency-Key", `"a \"quoted\" key"`)
	require.Equal(t, `a "quoted" key`, *got.Load())
	serve(h, http.MethodPost, "/orders", `{}`)
	require.Equal(t, "<none>", *got.Load())
	u := b.bridge.Route(httpbridge.RouteConfig{Scope: "u", KeyFormat: httpbridge.KeyUUID})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		k, _ := httpbridge.Key(r.Context())
		got.Store(&k)
	}))
	serve(u, http.MethodPost, "/u", `{}`, "Idempotency-Key", "550E8400-E29B-41D4-A716-446655440000")
	require.Equal(t, "550e8400-e29b-41d4-a716-446655440000", *got.Load())
}

// A middleware in front of the bridge that parses the form uses the body
// up: the bridge refuses the request (500) rather than fingerprint an
// empty body, under which requests with other forms would replay this
// one's response.
func TestBodyReadBeforeTheBridgeIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t, setupOpts{})
	route := b.bridge.Route(httpbridge.RouteConfig{Scope: "orders"})(&app{})
	parseFirst := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseForm()
		route.ServeHTTP(w, r)
	})
	readFirst := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		route.ServeHTTP(w, r)
	})
	for name, h := range map[string]http.Handler{"form parsed": parseFirst, "body read": readFirst} {
		got := serve(h, http.MethodPost, "/orders", "amount=1", "Idempotency-Key", "k-"+strings.ReplaceAll(name, " ", "-"), "Content-Type", "application/x-www-form-urlencoded")
		require.Equal(t, http.StatusInternalServerError, got.Code, name)
		require.Equal(t, "application/problem+json", got.Header.Get("Content-Type"), name)
	}
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM orders`), "nothing ran")
}
