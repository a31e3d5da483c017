package grpcretry_test

import (
	"context"
	"net"
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
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// trailing is an invoker that answers err with the trailer md, through
// the call's grpc.Trailer option, as a connection would.
func trailing(attempts *atomic.Int64, answer func(n int64) (metadata.MD, error)) grpc.UnaryInvoker {
	return func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, opts ...grpc.CallOption) error {
		md, err := answer(attempts.Add(1))
		for _, o := range opts {
			if t, ok := o.(grpc.TrailerCallOption); ok {
				*t.TrailerAddr = md
			}
		}
		return err
	}
}

func expiresIn(d time.Duration) metadata.MD {
	return metadata.Pairs(grpcretry.DefaultExpiresKey, time.Now().Add(d).UTC().Format(time.RFC3339Nano))
}

// TestStopsAtKeyExpiry: a key whose expiry comes before the next attempt
// could reach the server is not sent again: an *OutcomeUnknownError
// carries the key, the expiry and the last answer, whose code status.Code
// still reads.
func TestStopsAtKeyExpiry(t *testing.T) {
	t.Parallel()
	var attempts atomic.Int64
	inFlight := status.Error(codes.Aborted, "in flight")
	at := time.Now().Add(1500 * time.Millisecond)
	var last atomic.Int64 // when the last attempt was made, Unix ns
	invoker := trailing(&attempts, func(n int64) (metadata.MD, error) {
		last.Store(time.Now().UnixNano())
		return metadata.Pairs(grpcretry.DefaultExpiresKey, at.UTC().Format(time.RFC3339Nano)), inFlight
	})
	cfg := grpcretry.Config{Backoff: backoff.Backoff{Initial: 100 * time.Millisecond, Max: time.Second}, MaxAttempts: 10,
		NewKey: func() string { return "pay-7" }}
	err := grpcretry.UnaryClientInterceptor(cfg)(context.Background(), method, wrapperspb.String("x"), nil, nil, invoker)
	require.ErrorIs(t, err, grpcretry.ErrOutcomeUnknown)
	var ou *grpcretry.OutcomeUnknownError
	require.ErrorAs(t, err, &ou)
	require.Equal(t, "pay-7", ou.Key)
	require.True(t, at.Equal(ou.Expires))
	require.ErrorIs(t, err, inFlight, "it unwraps to the last answer")
	require.Equal(t, codes.Aborted, status.Code(err))
	require.Contains(t, err.Error(), "pay-7")
	require.Greater(t, attempts.Load(), int64(1), "retried while the key lasted")
	require.True(t, time.Unix(0, last.Load()).Before(at.Add(-grpcretry.ExpiryMargin)), "no attempt within ExpiryMargin of the expiry")

	// A key far from its expiry is retried as before.
	attempts.Store(0)
	invoker = trailing(&attempts, func(n int64) (metadata.MD, error) {
		if n < 3 {
			return expiresIn(time.Hour), inFlight
		}
		return expiresIn(time.Hour), nil
	})
	require.NoError(t, grpcretry.UnaryClientInterceptor(cfg)(context.Background(), method, wrapperspb.String("x"), nil, nil, invoker))
	require.EqualValues(t, 3, attempts.Load())
}

// TestFirstSentExpiredOnARetry: a retry the server refuses because the
// key's first_sent has expired means the earlier attempts' outcome is
// unknown; a first attempt refused so is the caller's own error.
func TestFirstSentExpiredOnARetry(t *testing.T) {
	t.Parallel()
	st, err := status.New(codes.InvalidArgument, "first_sent is expired").WithDetails(
		&errdetails.ErrorInfo{Reason: "FIRST_SENT_EXPIRED", Domain: grpcbridge.ErrorDomain})
	require.NoError(t, err)
	expired := st.Err()
	var attempts atomic.Int64
	invoker := trailing(&attempts, func(n int64) (metadata.MD, error) {
		if n == 1 {
			return nil, status.Error(codes.Unavailable, "down")
		}
		return nil, expired
	})
	err = grpcretry.UnaryClientInterceptor(grpcretry.Config{Backoff: fast})(context.Background(), method, wrapperspb.String("x"), nil, nil, invoker)
	var ou *grpcretry.OutcomeUnknownError
	require.ErrorAs(t, err, &ou)
	require.True(t, ou.Expires.IsZero())
	require.ErrorIs(t, err, expired)

	attempts.Store(1) // the first attempt answers expired
	err = grpcretry.UnaryClientInterceptor(grpcretry.Config{Backoff: fast})(context.Background(), method, wrapperspb.String("x"), nil, nil, invoker)
	require.NotErrorIs(t, err, grpcretry.ErrOutcomeUnknown)
	require.Equal(t, codes.InvalidArgument, status.Code(err))
}

// expiringServer is a real gRPC server whose CreateOrder always answers
// Aborted (in flight), with a RetryInfo delay and the key's expiry in the
// trailer, as grpcbridge does.
type expiringServer struct {
	testpb.UnimplementedOrdersServer
	calls   atomic.Int64
	expires time.Time
}

func (s *expiringServer) CreateOrder(ctx context.Context, _ *testpb.CreateOrderRequest) (*testpb.Order, error) {
	s.calls.Add(1)
	_ = grpc.SetTrailer(ctx, metadata.Pairs(grpcretry.DefaultExpiresKey, s.expires.UTC().Format(time.RFC3339)))
	st, _ := status.New(codes.Aborted, "in flight").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(300 * time.Millisecond)})
	return nil, st.Err()
}

func serve(t *testing.T, svc testpb.OrdersServer, opts ...grpc.ServerOption) string {
	t.Helper()
	srv := grpc.NewServer(opts...)
	testpb.RegisterOrdersServer(srv, svc)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() { srv.Stop(); <-served })
	return ln.Addr().String()
}

func dial(t *testing.T, addr string, cfg grpcretry.Config) testpb.OrdersClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(cfg)))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return testpb.NewOrdersClient(conn)
}

// TestStopsAtKeyExpiryOverGRPC: over a real connection, the trailer of an
// error answer carries the expiry, and the interceptor stops retrying
// before it.
func TestStopsAtKeyExpiryOverGRPC(t *testing.T) {
	t.Parallel()
	svc := &expiringServer{expires: time.Now().Add(3 * time.Second)}
	client := dial(t, serve(t, svc), grpcretry.Config{MaxAttempts: 100, Backoff: backoff.Backoff{Max: time.Second}})
	var trl metadata.MD
	start := time.Now()
	_, err := client.CreateOrder(context.Background(), &testpb.CreateOrderRequest{Item: "x"}, grpc.Trailer(&trl))
	require.ErrorIs(t, err, grpcretry.ErrOutcomeUnknown)
	require.Greater(t, svc.calls.Load(), int64(1), "retried while the key lasted")
	require.Less(t, time.Since(start), 3*time.Second, "stopped before the expiry")
	require.NotEmpty(t, trl.Get(grpcretry.DefaultExpiresKey), "the caller's own Trailer option still gets the trailer")
}

// TestStopsAtKeyExpiryAgainstTheBridge, end to end: a consumer holds a key
// under a lease whose row expires 6 s after its claim; calls of the same
// key get Aborted with that exact expiry, and the interceptor stops before
// it with ErrOutcomeUnknown instead of sending the key to a server that
// would run it anew (as a plain call after the expiry shows).
func TestStopsAtKeyExpiryAgainstTheBridge(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t)
	pg.Exec(t, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := grpcbridge.New(grpcbridge.Config{Ledger: ledger, RetryAfter: 300 * time.Millisecond, ClockSkew: time.Second,
		Methods: map[string]grpcbridge.MethodConfig{"/justonce.grpctest.v1.Orders/CreateOrder": {
			Scope: "orders", TTL: 6 * time.Second, AllowShortTTL: true}}})
	require.NoError(t, err)
	svc := &held{}
	addr := serve(t, svc, grpc.UnaryInterceptor(bridge.UnaryServerInterceptor()))

	lease, _, err := ledger.AcquireLease(context.Background(), inbox.Request{Key: inbox.Key{Scope: "orders", ID: "evt-9"},
		Source: "kafka", TTL: 6 * time.Second}, time.Minute)
	require.NoError(t, err)
	require.NotNil(t, lease, "the consumer holds the key")

	client := dial(t, addr, grpcretry.Config{MaxAttempts: 100, Backoff: backoff.Backoff{Max: time.Second}})
	ctx := metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "evt-9")
	start := time.Now()
	_, err = client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "book"})
	require.ErrorIs(t, err, grpcretry.ErrOutcomeUnknown)
	var ou *grpcretry.OutcomeUnknownError
	require.ErrorAs(t, err, &ou)
	require.Equal(t, "evt-9", ou.Key)
	require.Equal(t, codes.Aborted, status.Code(err))
	require.Less(t, time.Since(start), 6*time.Second)
	require.Zero(t, svc.runs.Load(), "the call never ran")
	require.EqualValues(t, 0, pg.Count(t, `SELECT count(*) FROM orders`))

	// What the client avoided: past the key's expiry the bridge runs the
	// same key anew.
	testsvc.Eventually(t, 10*time.Second, func() bool { return time.Now().After(ou.Expires.Add(time.Second)) }, "the key expires")
	plain := testpb.NewOrdersClient(func() *grpc.ClientConn {
		c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close() })
		return c
	}())
	_, err = plain.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "book"})
	require.NoError(t, err)
	require.EqualValues(t, 1, svc.runs.Load(), "ran anew after the expiry")
}
