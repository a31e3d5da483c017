package grpcretry_test

import (
	"context"
	"fmt"
	"net"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/grpcretry"
)

// The client side: a key (and first_sent) is added, and an Unavailable
// answer is retried with the same key. The server here only records what
// it gets; a grpcbridge interceptor is what would dedupe on the key.
func ExampleUnaryClientInterceptor() {
	var mu sync.Mutex
	var keys, sent []string
	pay := grpc.ServiceDesc{
		ServiceName: "example.Payments",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Pay",
			Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				in := new(wrapperspb.StringValue)
				if err := dec(in); err != nil {
					return nil, err
				}
				md, _ := metadata.FromIncomingContext(ctx)
				mu.Lock()
				defer mu.Unlock()
				keys = append(keys, md.Get("idempotency-key")...)
				sent = append(sent, md.Get("idempotency-first-sent")...)
				if len(keys) == 1 {
					return nil, status.Error(codes.Unavailable, "try again")
				}
				return wrapperspb.Int64(1), nil
			},
		}},
	}
	srv := grpc.NewServer()
	srv.RegisterService(&pay, nil)
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	conn, _ := grpc.NewClient(ln.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{})))
	defer conn.Close()
	out := new(wrapperspb.Int64Value)
	err := conn.Invoke(context.Background(), "/example.Payments/Pay", wrapperspb.String("carol"), out)
	fmt.Println("payment", out.GetValue(), err)
	mu.Lock()
	defer mu.Unlock()
	fmt.Println(len(keys), "attempts, same key:", keys[0] == keys[1], "key length:", len(keys[0]), "same first_sent:", sent[0] == sent[1])
	// Output:
	// payment 1 <nil>
	// 2 attempts, same key: true key length: 36 same first_sent: true
}
