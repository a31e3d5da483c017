package grpcbridge_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// TestStoredAnswerExpires: past the method's ResultTTL a retry does not
// run the handler again and gets AlreadyExists (RESPONSE_EXPIRED, with
// when it completed, the replay header and the expiry trailer); another
// request under the key is still IDEMPOTENCY_KEY_REUSED; the janitor
// clears the stored answer.
func TestStoredAnswerExpires(t *testing.T) {
	t.Parallel()
	e := setup(t, envOpts{cfg: grpcbridge.Config{Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "orders", TTL: time.Hour, ResultTTL: 500 * time.Millisecond},
	}}})
	ctx := ctxT(t)
	first, err := e.client.CreateOrder(withKey(ctx, "k-1"), &testpb.CreateOrderRequest{Item: "book", Quantity: 1})
	require.NoError(t, err)

	var err2 error
	var hdr, trl metadata.MD
	testsvc.Eventually(t, 10*time.Second, func() bool {
		var got *testpb.Order
		got, err2 = e.client.CreateOrder(withKey(ctx, "k-1"), &testpb.CreateOrderRequest{Item: "book", Quantity: 1},
			grpc.Header(&hdr), grpc.Trailer(&trl))
		if err2 == nil {
			require.Equal(t, first.GetId(), got.GetId())
			return false
		}
		return true
	}, "the stored answer expires")
	require.Equal(t, codes.AlreadyExists, status.Code(err2), "%v", err2)
	require.Equal(t, "RESPONSE_EXPIRED", reason(err2))
	ei, ok := detail[*errdetails.ErrorInfo](err2)
	require.True(t, ok)
	at, err := time.Parse(time.RFC3339, ei.GetMetadata()["completed_at"])
	require.NoError(t, err)
	require.WithinDuration(t, time.Now(), at, time.Minute)
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
	require.NotEmpty(t, trl.Get("idempotency-key-expires"))

	_, err = e.client.CreateOrder(withKey(ctx, "k-1"), &testpb.CreateOrderRequest{Item: "pen", Quantity: 1})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, "IDEMPOTENCY_KEY_REUSED", reason(err))
	require.EqualValues(t, 1, e.svc.runs.Load(), "the handler never ran again")
	require.Equal(t, 1, e.orders(t))

	_, err = e.ledger.Purge(context.Background(), inbox.JanitorConfig{})
	require.NoError(t, err)
	require.Equal(t, 0, e.pg.Count(t, `SELECT count(*) FROM processed_events WHERE response_body IS NOT NULL`))
	_, err = e.client.CreateOrder(withKey(ctx, "k-1"), &testpb.CreateOrderRequest{Item: "book", Quantity: 1})
	require.Equal(t, "RESPONSE_EXPIRED", reason(err))
	require.EqualValues(t, 1, e.svc.runs.Load())
}

// TestStaleResponseHook: the method's hook answers a retry whose stored
// answer is gone with the resource's current state; a hook without an
// answer leaves AlreadyExists.
func TestStaleResponseHook(t *testing.T) {
	t.Parallel()
	var e *env
	var got grpcbridge.StaleInfo
	hook := func(ctx context.Context, req any, info grpcbridge.StaleInfo) (any, error) {
		got = info
		if info.Key == "unknown" {
			return nil, nil
		}
		r := req.(*testpb.CreateOrderRequest)
		o := &testpb.Order{Item: r.GetItem()}
		err := e.pg.Pool.QueryRow(ctx, `SELECT id, quantity FROM orders WHERE item = $1`, r.GetItem()).Scan(&o.Id, &o.Quantity)
		return o, err
	}
	e = setup(t, envOpts{cfg: grpcbridge.Config{Methods: map[string]grpcbridge.MethodConfig{
		createOrder: {Scope: "orders", TTL: time.Hour, ResultTTL: 300 * time.Millisecond, StaleResponse: hook},
	}}})
	ctx := ctxT(t)
	first, err := e.client.CreateOrder(withKey(ctx, "k-1"), &testpb.CreateOrderRequest{Item: "book", Quantity: 3})
	require.NoError(t, err)
	_, err = e.client.CreateOrder(withKey(ctx, "unknown"), &testpb.CreateOrderRequest{Item: "pen", Quantity: 1})
	require.NoError(t, err)
	// The orders change after the first answer: the hook answers their
	// current state.
	e.pg.Exec(t, `UPDATE orders SET quantity = 4 WHERE item = 'book'`)

	var cur *testpb.Order
	var hdr metadata.MD
	testsvc.Eventually(t, 10*time.Second, func() bool {
		cur, err = e.client.CreateOrder(withKey(ctx, "k-1"), &testpb.CreateOrderRequest{Item: "book", Quantity: 3}, grpc.Header(&hdr))
		require.NoError(t, err)
		return cur.GetQuantity() == 4
	}, "the stored answer expires")
	require.Equal(t, first.GetId(), cur.GetId())
	require.Equal(t, []string{"true"}, hdr.Get("idempotent-replayed"))
	require.Equal(t, "k-1", got.Key)
	require.Equal(t, createOrder, got.Method)
	require.False(t, got.CompletedAt.IsZero())

	testsvc.Eventually(t, 10*time.Second, func() bool {
		_, err = e.client.CreateOrder(withKey(ctx, "unknown"), &testpb.CreateOrderRequest{Item: "pen", Quantity: 1})
		return err != nil
	}, "the second stored answer expires")
	require.Equal(t, "RESPONSE_EXPIRED", reason(err))
	require.EqualValues(t, 2, e.svc.runs.Load())
}
