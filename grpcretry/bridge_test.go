package grpcretry_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// held is an Orders service whose CreateOrder, once started is set, tells
// it is running and waits for release; it inserts the order in the
// bridge's transaction.
type held struct {
	testpb.UnimplementedOrdersServer
	runs             atomic.Int64
	started, release chan struct{}
}

func (h *held) CreateOrder(ctx context.Context, req *testpb.CreateOrderRequest) (*testpb.Order, error) {
	h.runs.Add(1)
	if h.started != nil {
		select {
		case h.started <- struct{}{}:
		default:
		}
		<-h.release
	}
	var id int64
	err := grpcbridge.Tx(ctx).QueryRow(ctx, `INSERT INTO orders (item) VALUES ($1) RETURNING id`, req.GetItem()).Scan(&id)
	return &testpb.Order{Id: id, Item: req.GetItem()}, err
}

// Against the server interceptor: the client puts a key and first_sent in
// the AEP field of a method that requires both, keeps the caller's message
// as it was, and retries an in-flight answer (Aborted) with the same key
// until it gets the replay.
func TestWithBridgeAEPField(t *testing.T) {
	pg := testsvc.Postgres(t)
	pg.Exec(t, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`)
	ledger, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	bridge, err := grpcbridge.New(grpcbridge.Config{Ledger: ledger, RetryAfter: 50 * time.Millisecond,
		Methods: map[string]grpcbridge.MethodConfig{"/justonce.grpctest.v1.Orders/CreateOrder": {
			Scope: "orders", Key: grpcbridge.KeyFromMessage, Required: true, RequireFirstSent: true, KeyFormat: grpcbridge.KeyUUID}}})
	require.NoError(t, err)
	svc := &held{}
	client := dial(t, serve(t, svc, grpc.UnaryInterceptor(bridge.UnaryServerInterceptor())),
		grpcretry.Config{MaxAttempts: 50, Backoff: backoff.Backoff{Initial: 10 * time.Millisecond}})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	_, err = client.CreateOrder(ctx, req)
	require.NoError(t, err)
	require.Nil(t, req.GetIdempotencyKey(), "the caller's message is not changed")
	require.EqualValues(t, 1, svc.runs.Load())

	// Explicit key: an in-flight answer is retried with the same key, and
	// the retry gets the replay.
	req = &testpb.CreateOrderRequest{Item: "pen", Quantity: 1, IdempotencyKey: &testpb.IdempotencyKey{Key: uuid.NewString(), FirstSent: timestamppb.Now()}}
	svc.started, svc.release = make(chan struct{}, 1), make(chan struct{})
	first := make(chan error, 1)
	go func() {
		_, err := client.CreateOrder(ctx, req)
		first <- err
	}()
	<-svc.started
	second := make(chan error, 1)
	var hdr metadata.MD
	go func() {
		_, err := client.CreateOrder(ctx, req, grpc.Header(&hdr))
		second <- err
	}()
	testsvc.Eventually(t, 5*time.Second, func() bool { return ledger.Counters().InFlight > 0 }, "the second call met the first in flight")
	close(svc.release)
	require.NoError(t, <-first)
	require.NoError(t, <-second)
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
	require.EqualValues(t, 2, svc.runs.Load())
	require.Equal(t, 2, pg.Count(t, `SELECT count(*) FROM orders`))
}
