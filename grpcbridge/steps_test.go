package grpcbridge_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/inbox"
)

// payments is a steps method whose "charge" step calls another justonce
// service (the provider: the test orders service behind its own bridge)
// through grpcretry, with the step's key.
type payments struct {
	testpb.UnimplementedOrdersServer
	provider   testpb.OrdersClient
	answerLost atomic.Bool // the next charge's answer is lost after the provider ran it
	mu         sync.Mutex
	refunds    []string
}

func (p *payments) CreateOrder(ctx context.Context, req *testpb.CreateOrderRequest) (*testpb.Order, error) {
	s := grpcbridge.Steps(ctx)
	if s == nil || grpcbridge.Tx(ctx) != nil {
		return nil, status.Error(codes.Internal, "not in steps")
	}
	s.Compensate("charge", func(ctx context.Context, key string, _ []byte) error {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.refunds = append(p.refunds, key)
		return nil
	})
	out, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
		ctx = metadata.AppendToOutgoingContext(ctx, grpcretry.DefaultMetadataKey, key)
		ord, err := p.provider.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: "charge", Quantity: 1})
		if err != nil {
			return nil, err
		}
		if p.answerLost.CompareAndSwap(true, false) {
			return nil, errors.New("connection lost") // charged, not recorded
		}
		return []byte(strconv.FormatInt(ord.GetId(), 10)), nil
	})
	if err != nil {
		return nil, status.Error(codes.Unavailable, err.Error()) // not stored: the client retries with the key
	}
	if req.GetItem() == "refused" {
		return nil, inbox.Permanent(status.Error(codes.FailedPrecondition, "card refused"))
	}
	id, _ := strconv.ParseInt(string(out), 10, 64)
	return &testpb.Order{Id: id, Item: req.GetItem()}, nil
}

// A steps method: a step whose answer was lost runs again with the same
// key and the provider runs it once; the retry resumes and completes; a
// third call replays; a permanent error compensates the charge and fails
// the key.
func TestStepsMethod(t *testing.T) {
	t.Parallel()
	provider := setup(t, envOpts{client: []grpc.DialOption{grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{}))}})
	svc := &payments{provider: provider.client}
	svc.answerLost.Store(true)
	bridge, err := grpcbridge.New(grpcbridge.Config{Ledger: provider.ledger, Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "payments", Steps: true}}})
	require.NoError(t, err)
	srv := grpc.NewServer(grpc.UnaryInterceptor(bridge.UnaryServerInterceptor()))
	testpb.RegisterOrdersServer(srv, svc)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	client := testpb.NewOrdersClient(conn)
	ctx := ctxT(t)

	_, err = client.CreateOrder(withKey(ctx, "p1"), &testpb.CreateOrderRequest{Item: "book"})
	require.Equal(t, codes.Unavailable, status.Code(err))
	var hdr metadata.MD
	ord, err := client.CreateOrder(withKey(ctx, "p1"), &testpb.CreateOrderRequest{Item: "book"}, grpc.Header(&hdr))
	require.NoError(t, err)
	require.Empty(t, hdr.Get("idempotent-replayed"))
	require.EqualValues(t, 1, provider.svc.runs.Load(), "the provider ran the repeated charge once")
	require.Equal(t, 1, provider.orders(t))
	again, err := client.CreateOrder(withKey(ctx, "p1"), &testpb.CreateOrderRequest{Item: "book"}, grpc.Header(&hdr))
	require.NoError(t, err)
	require.Equal(t, ord.GetId(), again.GetId())
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))

	_, err = client.CreateOrder(withKey(ctx, "p2"), &testpb.CreateOrderRequest{Item: "refused"})
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), "card refused")
	k2 := inbox.Key{Scope: "payments", ID: "p2"}
	require.Equal(t, []string{inbox.StepKey(k2, "compensate:charge")}, svc.refunds)
	_, err = client.CreateOrder(withKey(ctx, "p2"), &testpb.CreateOrderRequest{Item: "refused"})
	require.Equal(t, codes.FailedPrecondition, status.Code(err))
	require.Equal(t, "KEY_FAILED", reason(err))
	require.EqualValues(t, 2, provider.svc.runs.Load(), "one charge per payment")
	require.Len(t, svc.refunds, 1)
}

func TestStepsMethodConfig(t *testing.T) {
	t.Parallel()
	for _, mc := range []grpcbridge.MethodConfig{
		{Scope: "s", Steps: true, Observe: true},
		{Scope: "s", Steps: true, KeyRate: &inbox.KeyRate{Limit: func(string) int64 { return 1 }}},
		{Scope: "s", LeaseDuration: 1e9},
	} {
		_, err := grpcbridge.New(grpcbridge.Config{Ledger: &inbox.Ledger{}, Methods: map[string]grpcbridge.MethodConfig{createOrder: mc}})
		require.ErrorIs(t, err, inbox.ErrConfig)
	}
	require.Nil(t, grpcbridge.Steps(context.Background()))
}
