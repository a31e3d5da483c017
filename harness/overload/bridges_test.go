package overload_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/httpbridge"
	"github.com/justonce/justonce/httpretry"
	"github.com/justonce/justonce/inbox"
)

// The bottleneck: conns connections, each held hold by a request, so the
// ledger's capacity is conns/hold requests a second (200 here).
const (
	conns       = 4
	hold        = 20 * time.Millisecond
	capacity    = float64(conns) / 0.020
	offeredRate = 2 * capacity
	loadFor     = 3 * time.Second
	acquireWait = 250 * time.Millisecond
	baselineN   = 200
)

// world is one front's test: its schema (a pool of conns), ledger, the
// effects table (no unique constraint: a doubled effect is a second row)
// and the handler's runs.
type world struct {
	pg     *testsvc.PG
	ledger *inbox.Ledger
	runs   atomic.Int64
}

func newWorld(t *testing.T) *world {
	t.Helper()
	pg := testsvc.Postgres(t, testsvc.MaxConns(conns))
	pg.Exec(t, `CREATE TABLE effects (key text NOT NULL, n bigserial)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	return &world{pg: pg, ledger: l}
}

// attempts records every attempt a client made: the latency of those
// admitted (not shed), and the count of those shed.
type attempts struct {
	mu       sync.Mutex
	admitted []time.Duration
	shed     atomic.Int64
	shedKeys sync.Map
}

func (a *attempts) add(key string, d time.Duration, shed bool) {
	if shed {
		a.shed.Add(1)
		a.shedKeys.Store(key, true)
		return
	}
	a.mu.Lock()
	a.admitted = append(a.admitted, d)
	a.mu.Unlock()
}

func (a *attempts) p99() time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	return p99(a.admitted)
}

func p99(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*99/100)]
}

// offer calls call(i) for i in [0, n) at rate a second, open loop, and
// waits for every call to return.
func offer(n int, rate float64, call func(i int)) {
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		if d := time.Until(start.Add(time.Duration(float64(i) / rate * float64(time.Second)))); d > 0 {
			time.Sleep(d)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			call(i)
		}()
	}
	wg.Wait()
}

// run is the test both fronts share: a baseline unloaded, then twice the
// capacity, then the checks and the report. send sends the request of key
// through the front's retrying client and returns its final error.
func run(t *testing.T, w *world, front string, rec *attempts, send func(ctx context.Context, key string) error) {
	// A bound on the run, not a measure: on a machine loaded many times
	// over (the race detector at a load of 40 took 1.5 minutes) the retries
	// take long to converge.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	for i := range baselineN {
		require.NoError(t, send(ctx, fmt.Sprintf("base-%d", i)))
	}
	rec.mu.Lock()
	base := p99(rec.admitted)
	rec.admitted = nil
	rec.mu.Unlock()
	require.Zero(t, rec.shed.Load(), "shed unloaded")

	n := int(offeredRate * loadFor.Seconds())
	var failed atomic.Int64
	var firstErr sync.Once
	start := time.Now()
	offer(n, offeredRate, func(i int) {
		if err := send(ctx, fmt.Sprintf("load-%d", i)); err != nil {
			failed.Add(1)
			firstErr.Do(func() { t.Errorf("load-%d: %v", i, err) })
		}
	})
	took := time.Since(start)

	shedKeys := 0
	rec.shedKeys.Range(func(any, any) bool { shedKeys++; return true })
	total := baselineN + n
	require.Zero(t, failed.Load(), "requests without their answer in the end")
	require.Positive(t, rec.shed.Load(), "nothing was shed at twice the capacity")
	require.EqualValues(t, rec.shed.Load(), w.ledger.Counters().Overloaded, "shed attempts the ledger counted")
	require.EqualValues(t, total, w.runs.Load(), "handler runs: a shed attempt ran nothing, its retry ran once")
	require.Equal(t, total, w.pg.Count(t, `SELECT count(*) FROM effects`), "effects (doubled if more, lost if fewer)")
	require.Equal(t, total, w.pg.Count(t, `SELECT count(DISTINCT key) FROM effects`), "distinct effects")
	require.Equal(t, total, w.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'done'`), "ledger rows")

	loaded := rec.p99()
	t.Logf("overload %s: capacity %.0f/s (%d connections, each held %s), offered %.0f/s for %s (%d requests), AcquireWait %s; "+
		"%d attempts shed (%d keys), all %d requests answered in %s, each effect once; "+
		"p99 of admitted attempts %s loaded vs %s unloaded: ratio %.1f",
		front, capacity, conns, hold, offeredRate, loadFor, n, acquireWait,
		rec.shed.Load(), shedKeys, n, took.Round(time.Millisecond),
		loaded.Round(time.Millisecond), base.Round(time.Millisecond), float64(loaded)/float64(base))
}

func TestOverloadHTTP(t *testing.T) {
	w := newWorld(t)
	bridge, err := httpbridge.New(httpbridge.Config{Ledger: w.ledger, AcquireWait: acquireWait})
	require.NoError(t, err)
	h := bridge.Route(httpbridge.RouteConfig{Scope: "load", Required: true})(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w.runs.Add(1)
		key, _ := httpbridge.Key(r.Context())
		if _, err := httpbridge.Tx(r.Context()).Exec(r.Context(), `INSERT INTO effects (key) VALUES ($1)`, key); err != nil {
			http.Error(rw, err.Error(), http.StatusInternalServerError)
			return
		}
		time.Sleep(hold)
		rw.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(h)
	defer srv.Close()

	rec := &attempts{}
	base := &http.Transport{MaxIdleConnsPerHost: 2000, MaxConnsPerHost: 0}
	defer base.CloseIdleConnections()
	client := &http.Client{Transport: &httpretry.Transport{
		Base:        recordHTTP{base: base, rec: rec},
		MaxAttempts: 1000, // never the limit: every request must converge
		Backoff:     backoff.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
	}}
	run(t, w, "http", rec, func(ctx context.Context, key string) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"x"}`))
		if err != nil {
			return err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusCreated {
			return fmt.Errorf("%d %s", resp.StatusCode, body)
		}
		return nil
	})
}

// recordHTTP records each attempt httpretry makes.
type recordHTTP struct {
	base http.RoundTripper
	rec  *attempts
}

func (r recordHTTP) RoundTrip(req *http.Request) (*http.Response, error) {
	start := time.Now()
	resp, err := r.base.RoundTrip(req)
	if err != nil {
		return resp, err
	}
	shed := false
	if resp.StatusCode == http.StatusServiceUnavailable {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(body))
		shed = bytes.Contains(body, []byte(httpbridge.ProblemOverloaded)) && resp.Header.Get("Retry-After") != ""
	}
	r.rec.add(req.Header.Get("Idempotency-Key"), time.Since(start), shed)
	return resp, nil
}

const createOrder = "/justonce.grpctest.v1.Orders/CreateOrder"

type orders struct {
	testpb.UnimplementedOrdersServer
	w *world
}

func (o orders) CreateOrder(ctx context.Context, req *testpb.CreateOrderRequest) (*testpb.Order, error) {
	o.w.runs.Add(1)
	key, _ := grpcbridge.Key(ctx)
	if _, err := grpcbridge.Tx(ctx).Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, key); err != nil {
		return nil, err
	}
	time.Sleep(hold)
	return &testpb.Order{Item: req.GetItem(), Quantity: req.GetQuantity()}, nil
}

func TestOverloadGRPC(t *testing.T) {
	w := newWorld(t)
	bridge, err := grpcbridge.New(grpcbridge.Config{Ledger: w.ledger, AcquireWait: acquireWait,
		Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "load", Required: true}}})
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(bridge.UnaryServerInterceptor()))
	testpb.RegisterOrdersServer(srv, orders{w: w})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	rec := &attempts{}
	record := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		start := time.Now()
		err := invoker(ctx, method, req, reply, cc, opts...)
		md, _ := metadata.FromOutgoingContext(ctx)
		key := ""
		if k := md.Get(grpcretry.DefaultMetadataKey); len(k) > 0 {
			key = k[0]
		}
		rec.add(key, time.Since(start), overloaded(err))
		return err
	}
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(
			grpcretry.UnaryClientInterceptor(grpcretry.Config{MaxAttempts: 1000,
				Backoff: backoff.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}}),
			record))
	require.NoError(t, err)
	defer conn.Close()
	client := testpb.NewOrdersClient(conn)
	run(t, w, "grpc", rec, func(ctx context.Context, key string) error {
		ctx = metadata.AppendToOutgoingContext(ctx, grpcretry.DefaultMetadataKey, key)
		_, err := client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: key, Quantity: 1})
		return err
	})
}

// overloaded reports whether err is the bridge's shed answer: Unavailable
// with ErrorInfo OVERLOADED and a RetryInfo.
func overloaded(err error) bool {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Unavailable {
		return false
	}
	var reason bool
	var retry bool
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			reason = d.GetReason() == "OVERLOADED" && d.GetDomain() == grpcbridge.ErrorDomain
		case *errdetails.RetryInfo:
			retry = d.GetRetryDelay().AsDuration() > 0
		}
	}
	return reason && retry
}
