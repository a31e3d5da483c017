package grpcbridge_test

import (
	"context"
	"fmt"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/grpcbridge"
	"github.com/justonce/justonce/inbox"
)

// paymentsDesc is a hand-written service for the example, so that it
// needs no generated code: Pay takes an account name and answers the
// payment's ID. Generated services are registered the same way.
var paymentsDesc = grpc.ServiceDesc{
	ServiceName: "example.Payments",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Pay",
		Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.StringValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			info := &grpc.UnaryServerInfo{Server: srv, FullMethod: "/example.Payments/Pay"}
			return icpt(ctx, in, info, func(ctx context.Context, req any) (any, error) {
				return pay(ctx, req.(*wrapperspb.StringValue))
			})
		},
	}},
}

// pay writes in the ledger's transaction: the payment, the ledger row and
// the stored answer commit together, before the client gets the answer.
func pay(ctx context.Context, in *wrapperspb.StringValue) (*wrapperspb.Int64Value, error) {
	var id int64
	err := grpcbridge.Tx(ctx).QueryRow(ctx, `INSERT INTO payments (account) VALUES ($1) RETURNING id`, in.GetValue()).Scan(&id)
	if err != nil {
		return nil, status.Error(codes.Internal, "try again") // Internal: rolled back, key free
	}
	return wrapperspb.Int64(id), nil
}

// A method whose handler writes in the ledger's transaction: a retry with
// the same key gets the stored answer, marked as a replay.
func Example() {
	pool, done := exampleDB()
	defer done()

	ledger, _ := inbox.New(pool, inbox.Config{})
	bridge, err := grpcbridge.New(grpcbridge.Config{
		Ledger: ledger,
		Methods: map[string]grpcbridge.MethodConfig{
			"/example.Payments/Pay": {Scope: "payments", Required: true},
		},
	})
	if err != nil {
		panic(err)
	}
	srv := grpc.NewServer(grpc.UnaryInterceptor(bridge.UnaryServerInterceptor()))
	srv.RegisterService(&paymentsDesc, nil)
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	conn, _ := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	defer conn.Close()
	ctx := metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
	for i := 0; i < 2; i++ {
		var hdr metadata.MD
		out := new(wrapperspb.Int64Value)
		err := conn.Invoke(ctx, "/example.Payments/Pay", wrapperspb.String("alice"), out, grpc.Header(&hdr))
		fmt.Println("payment", out.GetValue(), err, "replayed:", len(hdr.Get("idempotent-replayed")) > 0)
	}
	// Without a key, a required method answers InvalidArgument.
	err = conn.Invoke(context.Background(), "/example.Payments/Pay", wrapperspb.String("bob"), new(wrapperspb.Int64Value))
	fmt.Println(status.Code(err))

	var n int
	_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM payments`).Scan(&n)
	fmt.Println("payments:", n)
	// Output:
	// payment 1 <nil> replayed: false
	// payment 1 <nil> replayed: true
	// InvalidArgument
	// payments: 1
}
