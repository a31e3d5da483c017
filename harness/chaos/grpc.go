package main

// The gRPC front: the gRPC bridge (grpcbridge) serving the test service's
// CreateOrder in worker processes, and clients in this process that call
// it with a key of their own in the metadata, several per key at once,
// retrying with grpcretry. Every key must have one effect, and every
// client of a key the same order.

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"strconv"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	gbackoff "google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/grpctest/testpb"
	"github.com/justonce/justonce/inbox"
)

const grpcMethod = "/justonce.grpctest.v1.Orders/CreateOrder"

// startGRPC starts the gRPC front: o.workers server processes, each on a
// port of its own, and the clients (keys g-0, g-1, ...).
func (e *env) startGRPC(ctx context.Context) error {
	e.sum.transports = append(e.sum.transports, "grpc")
	e.sum.unique["grpc"] = e.o.grpcKeys
	e.sum.produced["grpc"] = e.o.grpcKeys * e.o.httpClients
	e.sum.duplicates["grpc"] = e.o.grpcKeys * (e.o.httpClients - 1)
	var addrs []resolver.Address
	for i := 0; i < e.o.workers; i++ {
		addr := "127.0.0.1:" + strconv.Itoa(freePort())
		addrs = append(addrs, resolver.Address{Addr: addr})
		e.startSlot("grpc", i, append([]string{"-transport", "grpc", "-listen", addr}, e.common...))
	}
	// Round robin over the servers: a killed one's calls go to the others
	// while it restarts.
	r := manual.NewBuilderWithScheme("chaos")
	r.InitialState(resolver.State{Addresses: addrs})
	conn, err := grpc.NewClient(r.Scheme()+":///orders", grpc.WithResolvers(r),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"round_robin":{}}]}`),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: grpcBackoff, MinConnectTimeout: time.Second}),
		grpc.WithChainUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{MaxAttempts: 100,
			Backoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 500 * time.Millisecond}}),
			countShedGRPC(&e.sum.shed)))
	if err != nil {
		return err
	}
	e.onCleanup(func() { conn.Close() })
	client := testpb.NewOrdersClient(conn)
	l := &keyLoad{name: "grpc", sem: make(chan struct{}, 24), lat: e.stats.front("grpc")}
	l.send = func(ctx context.Context, key string) (string, error) {
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(ctx, grpcretry.DefaultMetadataKey, key), time.Minute)
		defer cancel()
		o, err := client.CreateOrder(ctx, &testpb.CreateOrderRequest{Item: key, Quantity: 1})
		if err != nil {
			return "", err
		}
		return strconv.FormatInt(o.GetId(), 10), nil
	}
	e.loads["grpc"] = l
	e.sum.keys["grpc"] = l
	if e.stats == nil {
		var keys []string
		for k := 0; k < e.o.grpcKeys; k++ {
			keys = append(keys, "g-"+strconv.Itoa(k))
		}
		l.sendAll(ctx, &e.reqWG, keys, e.o.httpClients)
		return nil
	}
	e.producers["grpc"] = l.producer(ctx, &e.reqWG, "g-", e.o.grpcKeys, e.o.httpClients)
	return nil
}

// countShedGRPC counts, in n, the attempts the bridge shed (Unavailable
// with the ErrorInfo reason OVERLOADED); it runs inside grpcretry, once
// per attempt.
func countShedGRPC(n *atomic.Int64) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if st, ok := status.FromError(err); ok && st.Code() == codes.Unavailable {
			for _, d := range st.Details() {
				if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == "OVERLOADED" {
					n.Add(1)
				}
			}
		}
		return err
	}
}

// grpcBackoff reconnects to a restarted server within a second.
var grpcBackoff = gbackoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second}

// ordersServer is CreateOrder on the bridge's transaction: one effect row
// per run, an order ID unique to the run.
type ordersServer struct {
	testpb.UnimplementedOrdersServer
}

func (ordersServer) CreateOrder(ctx context.Context, req *testpb.CreateOrderRequest) (*testpb.Order, error) {
	key, _ := grpcbridge.Key(ctx)
	if _, err := grpcbridge.Tx(ctx).Exec(ctx, `INSERT INTO effects (event_id, transport) VALUES ($1, 'grpc')`, key); err != nil {
		return nil, err
	}
	return &testpb.Order{Id: mrand.Int64(), Item: req.GetItem(), Quantity: req.GetQuantity()}, nil
}

// grpcWorker serves the bridge on listen until ctx ends.
func grpcWorker(ctx context.Context, l *inbox.Ledger, listen string) error {
	bridge, err := grpcbridge.New(grpcbridge.Config{Ledger: l, RetryAfter: 100 * time.Millisecond,
		Methods: map[string]grpcbridge.MethodConfig{grpcMethod: {Scope: scope, Required: true}}})
	if err != nil {
		return err
	}
	ln, err := listenRetry(listen)
	if err != nil {
		return err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(bridge.UnaryServerInterceptor()))
	testpb.RegisterOrdersServer(srv, ordersServer{})
	go func() {
		<-ctx.Done()
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(5 * time.Second):
			srv.Stop()
		}
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("grpc: %w", err)
	}
	return nil
}
