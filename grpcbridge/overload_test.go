package grpcbridge_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/harness/testsvc"
)

// With every connection of the ledger's pool in use for longer than
// Config.AcquireWait, a call is shed: Unavailable with OVERLOADED and a
// RetryInfo, keyed or keyless; the handler did not run and nothing was
// recorded, so the same key, called again once a connection is free, runs
// once.
func TestOverloadShedsWithUnavailable(t *testing.T) {
	pg := testsvc.Postgres(t, testsvc.MaxConns(1))
	pg.Exec(t, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL, quantity bigint NOT NULL)`)
	e := setup(t, envOpts{pg: pg, cfg: grpcbridge.Config{AcquireWait: 50 * time.Millisecond}})
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}

	held, err := pg.Pool.Acquire(context.Background())
	require.NoError(t, err)
	for name, ctx := range map[string]context.Context{"keyed": withKey(ctxT(t), "k-shed"), "keyless": ctxT(t)} {
		_, err := e.client.CreateOrder(ctx, req)
		require.Equal(t, codes.Unavailable, status.Code(err), "%s: %v", name, err)
		require.Equal(t, "OVERLOADED", reason(err), name)
		ri, ok := detail[*errdetails.RetryInfo](err)
		require.True(t, ok, name)
		require.Equal(t, 50*time.Millisecond, ri.GetRetryDelay().AsDuration(), name) // Config.RetryAfter
	}
	require.Zero(t, e.svc.runs.Load())
	require.EqualValues(t, 1, e.ledger.Counters().Overloaded) // the keyless call is not a ledger call
	held.Release()

	ctx := withKey(ctxT(t), "k-shed")
	first, err := e.client.CreateOrder(ctx, req)
	require.NoError(t, err)
	again, err := e.client.CreateOrder(ctx, req)
	require.NoError(t, err)
	require.Equal(t, first.GetId(), again.GetId(), "the replay")
	require.EqualValues(t, 1, e.svc.runs.Load())
	require.Equal(t, 1, e.orders(t))
}

func TestAcquireWaitNegativeIsRefused(t *testing.T) {
	_, err := grpcbridge.New(grpcbridge.Config{Ledger: deadLedger(t), AcquireWait: -1,
		Methods: map[string]grpcbridge.MethodConfig{createOrder: {Scope: "orders"}}})
	require.ErrorContains(t, err, "AcquireWait is negative")
}
