package grpcretry_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

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

// A key whose expiry passes while the operation's outcome is unknown is
// not sent again (the server would run it anew): the call fails with an
// *OutcomeUnknownError carrying the key and the last answer.
func ExampleOutcomeUnknownError() {
	pay := grpc.ServiceDesc{
		ServiceName: "example.Payments",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Pay",
			Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				if err := dec(new(wrapperspb.StringValue)); err != nil {
					return nil, err
				}
				// The first call is still running, and its key expires now.
				_ = grpc.SetTrailer(ctx, metadata.Pairs("idempotency-key-expires", time.Now().UTC().Format(time.RFC3339)))
				return nil, status.Error(codes.Aborted, "a call with this key is being processed")
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
		grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{NewKey: func() string { return "pay-42" }})))
	defer conn.Close()
	err := conn.Invoke(context.Background(), "/example.Payments/Pay", wrapperspb.String("carol"), new(wrapperspb.Int64Value))
	var unknown *grpcretry.OutcomeUnknownError
	if errors.As(err, &unknown) {
		fmt.Println("outcome unknown:", errors.Is(err, grpcretry.ErrOutcomeUnknown))
		fmt.Println("key:", unknown.Key)
		fmt.Println("last answer:", status.Code(unknown.Err))
	}
	// Output:
	// outcome unknown: true
	// key: pay-42
	// last answer: Aborted
}
