package grpcbridge_test

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// 500 concurrent identical calls run the handler once. The first holds the
// key for a while, so the others are answered Aborted (in flight) or, once
// it committed, with the replay; the client interceptor retries the
// Aborted ones with the same key until every caller has the one order.
func TestConcurrentIdenticalCallsRunOnce(t *testing.T) {
	e := setup(t, envOpts{client: []grpc.DialOption{grpc.WithUnaryInterceptor(
		grpcretry.UnaryClientInterceptor(grpcretry.Config{MaxAttempts: 200,
			Backoff: backoff.Backoff{Initial: 10 * time.Millisecond, Max: 100 * time.Millisecond}}))}})
	ctx := withKey(ctxT(t), uuid.NewString())
	const n = 500
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		ids      = map[int64]int{}
		replayed int
		errs     []error
	)
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			var hdr metadata.MD
			o, err := e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "book", Quantity: 1, SleepMs: 300}, grpc.Header(&hdr))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			ids[o.GetId()]++
			if len(hdr.Get("idempotent-replayed")) == 1 && hdr.Get("idempotent-replayed")[0] == "true" {
				replayed++
			}
		}()
	}
	close(start)
	wg.Wait()
	require.Empty(t, errs)
	require.Len(t, ids, 1, "every caller got the same order")
	require.Equal(t, 1, e.orders(t))
	require.EqualValues(t, 1, e.svc.runs.Load())
	require.Equal(t, n-1, replayed, "all but the first answer are replays")
	c := e.ledger.Counters()
	require.EqualValues(t, 1, c.Executed)
	require.Greater(t, c.InFlight, uint64(0), "some calls were answered in flight while the first ran")
	require.GreaterOrEqual(t, c.Duplicates, uint64(n-1))
	t.Logf("in flight answers: %d, replays: %d", c.InFlight, c.Duplicates)
}

func TestMismatch(t *testing.T) {
	e := setup(t, envOpts{})
	ctx := withKey(ctxT(t), "k-mismatch")
	_, err := e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "book", Quantity: 1})
	require.NoError(t, err)
	_, err = e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "book", Quantity: 2})
	require.Equal(t, codes.InvalidArgument, status.Code(err), err)
	require.Equal(t, "IDEMPOTENCY_KEY_REUSED", reason(err))
	br, ok := detail[*errdetails.BadRequest](err)
	require.True(t, ok)
	require.Equal(t, "idempotency-key", br.GetFieldViolations()[0].GetField())
	require.Equal(t, 1, e.orders(t))
}

func TestInFlightAnswersAbortedWithRetryInfo(t *testing.T) {
	e := setup(t, envOpts{})
	e.svc.started, e.svc.release = make(chan struct{}, 1), make(chan struct{})
	ctx := withKey(ctxT(t), "k-inflight")
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	done := make(chan error, 1)
	go func() {
		_, err := e.client.CreateOrder(ctx, req)
		done <- err
	}()
	<-e.svc.started
	_, err := e.client.CreateOrder(ctx, req)
	require.Equal(t, codes.Aborted, status.Code(err), err)
	require.Equal(t, "REQUEST_IN_PROGRESS", reason(err))
	ri, ok := detail[*errdetails.RetryInfo](err)
	require.True(t, ok)
	require.Equal(t, 50*time.Millisecond, ri.GetRetryDelay().AsDuration())
	close(e.svc.release)
	require.NoError(t, <-done)
	var hdr metadata.MD
	_, err = e.client.CreateOrder(ctx, req, grpc.Header(&hdr))
	require.NoError(t, err)
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
	require.Equal(t, 1, e.orders(t))
}

// The replay is the stored message, byte for byte as the first answer was
// sent, with the same header (plus the replay mark) and trailer metadata;
// a stored error status comes back with its details.
func TestReplayByteForByte(t *testing.T) {
	e := setup(t, envOpts{})
	ctx := withKey(ctxT(t), "k-replay")
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 3, Tags: []string{"b", "a"}}
	call := func() ([]byte, metadata.MD, metadata.MD) {
		var raw []byte
		var hdr, trl metadata.MD
		err := e.conn.Invoke(ctx, createOrder, req, &raw, grpc.ForceCodec(rawCodec{}), grpc.Header(&hdr), grpc.Trailer(&trl))
		require.NoError(t, err)
		return raw, hdr, trl
	}
	first, h1, t1 := call()
	again, h2, t2 := call()
	require.True(t, bytes.Equal(first, again), "first %x\nreplay %x", first, again)
	require.Empty(t, h1.Get("idempotent-replayed"))
	require.Equal(t, []string{"true"}, h2.Get("idempotent-replayed"))
	require.Equal(t, h1.Get("x-order"), h2.Get("x-order"))
	require.Equal(t, []string{"\x00\x01\xff"}, h2.Get("x-trace-bin"))
	require.Equal(t, t1.Get("x-done"), t2.Get("x-done"))
	require.Equal(t, []string{"session=s1"}, h1.Get("set-cookie"), "the first answer carries its credentials")
	require.Empty(t, h2.Get("set-cookie"), "credentials are never stored nor replayed")
	var o testpb.Order
	require.NoError(t, proto.Unmarshal(again, &o))
	require.Equal(t, []string{"b", "a"}, o.GetTags())
	require.Equal(t, 1, e.orders(t))

	// A stored error (NotFound is kept by DefaultStore) replays its status.
	ctx2 := withKey(ctxT(t), "k-replay-err")
	freq := &testpb.CreateOrderRequest{Item: "x", FailCode: int32(codes.NotFound)}
	_, err1 := e.client.CreateOrder(ctx2, freq)
	var hdr metadata.MD
	_, err2 := e.client.CreateOrder(ctx2, freq, grpc.Header(&hdr))
	require.Equal(t, codes.NotFound, status.Code(err1))
	p1, _ := proto.Marshal(status.Convert(err1).Proto())
	p2, _ := proto.Marshal(status.Convert(err2).Proto())
	require.Equal(t, p1, p2, "same code, message and details")
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
	require.Equal(t, 2, e.orders(t), "a stored error commits the handler's writes")
	require.EqualValues(t, 2, e.svc.runs.Load())
}

// Released codes (Unavailable, Internal, DeadlineExceeded, Canceled) roll
// back and free the key; a retry runs again.
func TestReleasedCodesRollBack(t *testing.T) {
	e := setup(t, envOpts{})
	for i, c := range []codes.Code{codes.Unavailable, codes.Internal, codes.DeadlineExceeded, codes.Canceled} {
		ctx := withKey(ctxT(t), "k-release-"+c.String())
		_, err := e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "x", FailCode: int32(c)})
		require.Equal(t, c, status.Code(err))
		_, err = e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "x", FailCode: int32(c)})
		require.Equal(t, c, status.Code(err))
		require.EqualValues(t, 3*i+2, e.svc.runs.Load(), "the retry ran again")
		o, err := e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "x"})
		require.NoError(t, err)
		require.NotZero(t, o.GetId())
	}
	require.Equal(t, 4, e.orders(t), "only the successful calls' writes committed")
}

func TestPanicRollsBackAndFreesTheKey(t *testing.T) {
	e := setup(t, envOpts{})
	ctx := withKey(ctxT(t), "k-panic")
	_, err := e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "x", Panic: true})
	require.Equal(t, codes.Internal, status.Code(err))
	require.EqualValues(t, 1, e.panics.Load(), "re-raised to the recovery interceptor")
	_, err = e.ledger.Lookup(ctxT(t), inbox.Key{Scope: "orders", ID: "k-panic"})
	require.ErrorIs(t, err, inbox.ErrNotFound)
	require.Equal(t, 0, e.orders(t))
	o, err := e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "x"})
	require.NoError(t, err)
	require.NotZero(t, o.GetId())
	require.Equal(t, 1, e.orders(t))
}

// A client that cancels while the handler runs: the handler finishes and
// commits, and the client's retry gets the replay.
func TestClientCancelsMidHandler(t *testing.T) {
	e := setup(t, envOpts{cfg: grpcbridge.Config{Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "orders", LockWait: 10 * time.Second}}}})
	e.svc.started, e.svc.release = make(chan struct{}, 1), make(chan struct{})
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	cctx, cancel := context.WithCancel(withKey(context.Background(), "k-cancel"))
	done := make(chan error, 1)
	go func() {
		_, err := e.client.CreateOrder(cctx, req)
		done <- err
	}()
	<-e.svc.started
	cancel()
	require.Equal(t, codes.Canceled, status.Code(<-done))
	close(e.svc.release) // the handler goes on after the client left
	var hdr metadata.MD
	o, err := e.client.CreateOrder(withKey(ctxT(t), "k-cancel"), req, grpc.Header(&hdr))
	require.NoError(t, err)
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"), "the retry waited (LockWait) and got the replay")
	require.NotZero(t, o.GetId())
	require.Equal(t, 1, e.orders(t))
	require.EqualValues(t, 1, e.svc.runs.Load())
}

// Postgres unreachable: Unavailable with RetryInfo, nothing recorded;
// once it is back, the retry with the same key runs once.
func TestStoreUnavailable(t *testing.T) {
	pg := testsvc.Postgres(t, testsvc.MaxConns(16))
	pg.Exec(t, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL, quantity bigint NOT NULL)`)
	proxy := testsvc.Proxy(t, pg.Host())
	e := setup(t, envOpts{pg: pg, pool: pg.PoolVia(t, proxy.Addr(), 4)})
	ctx := withKey(ctxT(t), "k-down")
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}

	proxy.Refuse(true)
	proxy.CutAll()
	_, err := e.client.CreateOrder(ctx, req)
	require.Equal(t, codes.Unavailable, status.Code(err), err)
	require.Equal(t, "STORE_UNAVAILABLE", reason(err))
	_, ok := detail[*errdetails.RetryInfo](err)
	require.True(t, ok)

	// Cut while the handler runs: rolled back, answered Unavailable.
	proxy.Refuse(false)
	e.svc.started, e.svc.release = make(chan struct{}, 1), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := e.client.CreateOrder(ctx, req)
		done <- err
	}()
	<-e.svc.started
	proxy.Refuse(true)
	proxy.CutAll()
	close(e.svc.release)
	err = <-done
	require.Equal(t, codes.Unavailable, status.Code(err), err)
	require.Equal(t, 0, e.orders(t), "nothing committed")

	proxy.Refuse(false)
	e.svc.started, e.svc.release = nil, nil
	// The cut session's backend may not have ended yet, its lock on the
	// key with it: the retry is answered Aborted (in flight) until then,
	// as a client retrying after RetryInfo would see.
	var o *testpb.Order
	testsvc.Eventually(t, 30*time.Second, func() bool {
		o, err = e.client.CreateOrder(ctx, req)
		return status.Code(err) != codes.Aborted
	}, "the cut session's lock is gone")
	require.NoError(t, err)
	require.NotZero(t, o.GetId())
	_, err = e.client.CreateOrder(ctx, req)
	require.NoError(t, err)
	require.Equal(t, 1, e.orders(t), "nothing lost, nothing twice")
}

func TestMissingAndInvalidKeys(t *testing.T) {
	e := setup(t, envOpts{cfg: grpcbridge.Config{Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "orders", Required: true, KeyFormat: grpcbridge.KeyUUID},
		getOrder:    {Off: true}}}})
	ctx := ctxT(t)
	_, err := e.client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "x"})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, "IDEMPOTENCY_KEY_MISSING", reason(err))
	_, err = e.client.CreateOrder(withKey(ctx, "not-a-uuid"), &testpb.CreateOrderRequest{Item: "x"})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, "IDEMPOTENCY_KEY_INVALID", reason(err))
	br, ok := detail[*errdetails.BadRequest](err)
	require.True(t, ok)
	require.Equal(t, "idempotency-key", br.GetFieldViolations()[0].GetField())
	two := metadata.AppendToOutgoingContext(ctx, "idempotency-key", uuid.NewString(), "idempotency-key", uuid.NewString())
	_, err = e.client.CreateOrder(two, &testpb.CreateOrderRequest{Item: "x"})
	require.Equal(t, "IDEMPOTENCY_KEY_INVALID", reason(err))
	// Upper-case UUIDs are the same key.
	k := uuid.NewString()
	o1, err := e.client.CreateOrder(withKey(ctx, k), &testpb.CreateOrderRequest{Item: "x"})
	require.NoError(t, err)
	o2, err := e.client.CreateOrder(withKey(ctx, bytesUpper(k)), &testpb.CreateOrderRequest{Item: "x"})
	require.NoError(t, err)
	require.Equal(t, o1.GetId(), o2.GetId())
	require.Equal(t, 1, e.orders(t))
}

func bytesUpper(s string) string { return string(bytes.ToUpper([]byte(s))) }

// AEP-155: the key and first_sent in the request message.
func TestFirstSentRules(t *testing.T) {
	e := setup(t, envOpts{cfg: grpcbridge.Config{ClockSkew: time.Minute, Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "orders", Key: grpcbridge.KeyFromMessage, KeyFormat: grpcbridge.KeyAEP, TTL: time.Hour}}}})
	ctx := ctxT(t)
	now := time.Now()
	mk := func(key string, fs *timestamppb.Timestamp) *testpb.CreateOrderRequest {
		return &testpb.CreateOrderRequest{Item: "book", Quantity: 1, IdempotencyKey: &testpb.IdempotencyKey{Key: key, FirstSent: fs}}
	}
	refused := func(req *testpb.CreateOrderRequest, want, field string) {
		t.Helper()
		_, err := e.client.CreateOrder(ctx, req)
		require.Equal(t, codes.InvalidArgument, status.Code(err), err)
		require.Equal(t, want, reason(err), err)
		br, ok := detail[*errdetails.BadRequest](err)
		require.True(t, ok)
		require.Equal(t, field, br.GetFieldViolations()[0].GetField())
	}
	refused(mk("k-future", timestamppb.New(now.Add(2*time.Minute))), "FIRST_SENT_IN_FUTURE", "idempotency_key.first_sent")
	refused(mk("k-expired", timestamppb.New(now.Add(-time.Hour+30*time.Second))), "FIRST_SENT_EXPIRED", "idempotency_key.first_sent")
	refused(mk("k-bad", &timestamppb.Timestamp{Seconds: now.Unix(), Nanos: -1}), "FIRST_SENT_INVALID", "idempotency_key.first_sent")
	refused(mk("", timestamppb.New(now)), "IDEMPOTENCY_KEY_INVALID", "idempotency_key.key")
	refused(mk("0123456789012345678901234567890123456", timestamppb.New(now)), "IDEMPOTENCY_KEY_INVALID", "idempotency_key.key")
	require.Equal(t, 0, e.orders(t))

	// Within the skew: accepted. A retry with another first_sent is refused;
	// with the same, replayed.
	fs := timestamppb.New(now.Add(30 * time.Second))
	o1, err := e.client.CreateOrder(ctx, mk("k-ok", fs))
	require.NoError(t, err)
	refused(mk("k-ok", timestamppb.New(now)), "FIRST_SENT_CHANGED", "idempotency_key.first_sent")
	var hdr metadata.MD
	o2, err := e.client.CreateOrder(ctx, mk("k-ok", fs), grpc.Header(&hdr))
	require.NoError(t, err)
	require.Equal(t, o1.GetId(), o2.GetId())
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
	// The idempotency field is not part of the fingerprint; no first_sent
	// at all is accepted (RequireFirstSent is off) and replays.
	o3, err := e.client.CreateOrder(ctx, mk("k-ok", nil))
	require.NoError(t, err)
	require.Equal(t, o1.GetId(), o3.GetId())
	require.Equal(t, 1, e.orders(t))

	// Metadata form.
	e2 := setup(t, envOpts{pg: e.pg, cfg: grpcbridge.Config{Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "orders-md", RequireFirstSent: true}}}})
	_, err = e2.client.CreateOrder(withKey(ctx, "m1"), mk("", nil))
	require.Equal(t, "FIRST_SENT_MISSING", reason(err))
	_, err = e2.client.CreateOrder(metadata.AppendToOutgoingContext(ctx, "idempotency-key", "m1", "idempotency-first-sent", "yesterday"), mk("", nil))
	require.Equal(t, "FIRST_SENT_INVALID", reason(err))
	_, err = e2.client.CreateOrder(withKey(ctx, "m1", now.Add(time.Hour)), mk("", nil))
	require.Equal(t, "FIRST_SENT_IN_FUTURE", reason(err))
	br, _ := detail[*errdetails.BadRequest](err)
	require.Equal(t, "idempotency-first-sent", br.GetFieldViolations()[0].GetField())
	_, err = e2.client.CreateOrder(withKey(ctx, "m1", now), mk("", nil))
	require.NoError(t, err)
}

func TestConfigValidate(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none") // never dialled
	require.NoError(t, err)
	defer pool.Close()
	l, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	bad := []grpcbridge.Config{
		{},
		{Ledger: l},
		{Ledger: l, Methods: map[string]grpcbridge.MethodConfig{"CreateOrder": {Scope: "s"}}},
		{Ledger: l, Methods: map[string]grpcbridge.MethodConfig{createOrder: {}}},
		{Ledger: l, Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "s", Field: "x"}}},
		{Ledger: l, MetadataKey: "Idempotency-Key", Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "s"}}},
		{Ledger: l, Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "s", TTL: time.Minute}}},
	}
	for i, c := range bad {
		_, err := grpcbridge.New(c)
		require.ErrorIs(t, err, inbox.ErrConfig, "case %d", i)
	}
	_, err = grpcbridge.New(grpcbridge.Config{Ledger: l, Methods: map[string]grpcbridge.MethodConfig{
		"/justonce.grpctest.v1.Orders/*": {Scope: "s"}, getOrder: {Off: true}}})
	require.NoError(t, err)
}

// Config.DenyMetadata keys are neither stored nor replayed; the first
// answer still carries them.
func TestDenyMetadata(t *testing.T) {
	e := setup(t, envOpts{cfg: grpcbridge.Config{
		Methods:      map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders"}},
		DenyMetadata: []string{"X-Order"},
	}})
	ctx := withKey(ctxT(t), "k-deny")
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	var h1, h2 metadata.MD
	_, err := e.client.CreateOrder(ctx, req, grpc.Header(&h1))
	require.NoError(t, err)
	_, err = e.client.CreateOrder(ctx, req, grpc.Header(&h2))
	require.NoError(t, err)
	require.NotEmpty(t, h1.Get("x-order"))
	require.Equal(t, []string{"true"}, h2.Get("idempotent-replayed"))
	require.Empty(t, h2.Get("x-order"))
	require.NotEmpty(t, h2.Get("x-trace-bin"), "other metadata is replayed")
}
