package grpcbridge_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/inbox"
)

// checkoutDesc is example.Checkout/Buy, a method in steps: its "charge"
// step calls example.Payments/Pay, another method behind the bridge,
// through grpcretry with the step's key.
func checkoutDesc(payments *grpc.ClientConn, answerLost *bool) *grpc.ServiceDesc {
	buy := func(ctx context.Context, _ any) (any, error) {
		s := grpcbridge.Steps(ctx)
		out, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			ctx = metadata.AppendToOutgoingContext(ctx, grpcretry.DefaultMetadataKey, key) // inbox.StepKey(s.Key(), "charge")
			id := new(wrapperspb.Int64Value)
			if err := payments.Invoke(ctx, "/example.Payments/Pay", wrapperspb.String("alice"), id); err != nil {
				return nil, err
			}
			if *answerLost {
				*answerLost = false
				return nil, errors.New("connection lost") // paid, not recorded
			}
			return []byte(strconv.FormatInt(id.GetValue(), 10)), nil
		})
		if err != nil {
			return nil, status.Error(codes.Unavailable, err.Error()) // not stored: retry with the key
		}
		return wrapperspb.String("payment " + string(out)), nil
	}
	return &grpc.ServiceDesc{
		ServiceName: "example.Checkout",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Buy",
			Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
				in := new(wrapperspb.StringValue)
				if err := dec(in); err != nil {
					return nil, err
				}
				return icpt(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: "/example.Checkout/Buy"}, buy)
			},
		}},
	}
}

// A method in steps whose step calls another method behind the bridge (a
// justonce service of its own) with the step's key: the first attempt
// loses the answer after the payment was made, the retry calls again with
// the same key and gets the stored answer, and the payment is made once.
func ExampleSteps() {
	pool, done := exampleDB()
	defer done()
	ledger, _ := inbox.New(pool, inbox.Config{})
	bridge, err := grpcbridge.New(grpcbridge.Config{
		Ledger: ledger,
		Methods: map[string]grpcbridge.MethodConfig{
			"/example.Payments/Pay": {Scope: "payments", Required: true},
			"/example.Checkout/Buy": {Scope: "checkout", Required: true, Steps: true},
		},
	})
	if err != nil {
		panic(err)
	}
	calls := 0 // of example.Payments/Pay
	count := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if info.FullMethod == "/example.Payments/Pay" {
			calls++
		}
		return h(ctx, req)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(count, bridge.UnaryServerInterceptor()))
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	conn, _ := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{})))
	defer conn.Close()
	answerLost := true
	srv.RegisterService(&paymentsDesc, nil)
	srv.RegisterService(checkoutDesc(conn, &answerLost), nil)
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	client, _ := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	defer client.Close()
	ctx := metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "order-1")
	for i := 0; i < 3; i++ { // the client's retries, by hand
		var hdr metadata.MD
		out := new(wrapperspb.StringValue)
		err := client.Invoke(ctx, "/example.Checkout/Buy", wrapperspb.String("book"), out, grpc.Header(&hdr))
		fmt.Printf("%s %q replayed: %t; Pay called %d times\n", status.Code(err), out.GetValue(), len(hdr.Get("idempotent-replayed")) > 0, calls)
	}
	var n int
	_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM payments`).Scan(&n)
	fmt.Println("payments:", n)
	// Output:
	// Unavailable "" replayed: false; Pay called 1 times
	// OK "payment 1" replayed: false; Pay called 2 times
	// OK "payment 1" replayed: true; Pay called 2 times
	// payments: 1
}
