package grpcretry_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/harness/grpctest/testpb"
)

// attempt is what one call of the invoker was given.
type attempt struct {
	md  metadata.MD
	req any
}

// fake is an invoker that answers the given errors in turn, then OK, and
// records each attempt.
type fake struct {
	mu       sync.Mutex
	answers  []error
	attempts []attempt
}

func (f *fake) invoke(ctx context.Context, _ string, req, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
	md, _ := metadata.FromOutgoingContext(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.attempts = append(f.attempts, attempt{md: md.Copy(), req: req})
	if n := len(f.attempts); n <= len(f.answers) {
		return f.answers[n-1]
	}
	return nil
}

var fast = backoff.Backoff{Initial: time.Millisecond, Max: 5 * time.Millisecond}

func call(t *testing.T, cfg grpcretry.Config, ctx context.Context, method string, req any, answers ...error) (*fake, error) {
	t.Helper()
	f := &fake{answers: answers}
	err := grpcretry.UnaryClientInterceptor(cfg)(ctx, method, req, nil, nil, f.invoke)
	return f, err
}

const method = "/pkg.Service/Create"

// A request without an AEP field gets a UUID v4 key and first_sent in
// metadata, the same on every attempt; the message itself is not changed.
func TestKeyInMetadata(t *testing.T) {
	t.Parallel()
	req := wrapperspb.String("book")
	before := time.Now().UTC()
	f, err := call(t, grpcretry.Config{Backoff: fast}, context.Background(), method, req,
		status.Error(codes.Unavailable, "down"), status.Error(codes.Aborted, "in flight"))
	require.NoError(t, err)
	require.Len(t, f.attempts, 3)
	first := f.attempts[0]
	keys := first.md.Get(grpcretry.DefaultMetadataKey)
	require.Len(t, keys, 1)
	u, err := uuid.Parse(keys[0])
	require.NoError(t, err)
	require.Equal(t, uuid.Version(4), u.Version())
	sent := first.md.Get(grpcretry.DefaultFirstSentKey)
	require.Len(t, sent, 1)
	fs, err := time.Parse(time.RFC3339Nano, sent[0])
	require.NoError(t, err)
	require.False(t, fs.Before(before.Truncate(time.Second)) || fs.After(time.Now()), "first_sent %s is the first attempt's time", fs)
	for _, a := range f.attempts {
		require.Equal(t, first.md, a.md, "every attempt carries the same key and first_sent")
		require.Same(t, req, a.req, "the message is not changed")
	}
	require.Equal(t, "book", req.GetValue())
}

// A request with an AEP-155 IdempotencyKey field gets the key and
// first_sent there, on a copy: the caller's message stays as it was, and
// nothing goes in metadata.
func TestKeyInAEPField(t *testing.T) {
	t.Parallel()
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 1}
	f, err := call(t, grpcretry.Config{Backoff: fast}, context.Background(), method, req, status.Error(codes.Unavailable, "down"))
	require.NoError(t, err)
	require.Len(t, f.attempts, 2)
	sent := f.attempts[0].req.(*testpb.CreateOrderRequest)
	require.NotSame(t, req, sent)
	require.Nil(t, req.GetIdempotencyKey(), "the caller's message is not changed")
	_, err = uuid.Parse(sent.GetIdempotencyKey().GetKey())
	require.NoError(t, err)
	require.NotNil(t, sent.GetIdempotencyKey().GetFirstSent())
	require.WithinDuration(t, time.Now(), sent.GetIdempotencyKey().GetFirstSent().AsTime(), time.Minute)
	require.Equal(t, "book", sent.GetItem())
	require.True(t, proto.Equal(sent, f.attempts[1].req.(proto.Message)), "the retry sends the same key and first_sent")
	for _, a := range f.attempts {
		require.Empty(t, a.md.Get(grpcretry.DefaultMetadataKey))
		require.Empty(t, a.md.Get(grpcretry.DefaultFirstSentKey))
	}
}

// A key the caller set is kept: in the field (its first_sent, set or not,
// too) or in metadata (the message is then not changed).
func TestCallerKeyKept(t *testing.T) {
	t.Parallel()
	req := &testpb.CreateOrderRequest{Item: "book", IdempotencyKey: &testpb.IdempotencyKey{Key: "mine"}}
	f, err := call(t, grpcretry.Config{}, context.Background(), method, req)
	require.NoError(t, err)
	require.Same(t, req, f.attempts[0].req)
	require.Nil(t, req.GetIdempotencyKey().GetFirstSent())

	fs := timestamppb.New(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	req = &testpb.CreateOrderRequest{Item: "book", IdempotencyKey: &testpb.IdempotencyKey{Key: "mine", FirstSent: fs}}
	f, err = call(t, grpcretry.Config{}, context.Background(), method, req)
	require.NoError(t, err)
	require.Same(t, req, f.attempts[0].req)

	ctx := metadata.AppendToOutgoingContext(context.Background(), "idempotency-key", "from-md")
	req = &testpb.CreateOrderRequest{Item: "book"}
	f, err = call(t, grpcretry.Config{}, ctx, method, req)
	require.NoError(t, err)
	require.Same(t, req, f.attempts[0].req, "a key in metadata wins over the field")
	require.Equal(t, []string{"from-md"}, f.attempts[0].md.Get("idempotency-key"))
	require.Empty(t, f.attempts[0].md.Get("idempotency-first-sent"), "no first_sent is invented for the caller's key")
}

// A plain string field named by Config.Field gets the key, on a copy.
func TestKeyInStringField(t *testing.T) {
	t.Parallel()
	cfg := grpcretry.Config{Field: "value", NewKey: func() string { return "k-1" }}
	req := wrapperspb.String("")
	f, err := call(t, cfg, context.Background(), method, req)
	require.NoError(t, err)
	require.Equal(t, "k-1", f.attempts[0].req.(*wrapperspb.StringValue).GetValue())
	require.Empty(t, req.GetValue())
	require.Empty(t, f.attempts[0].md.Get("idempotency-key"))

	req = wrapperspb.String("caller's")
	f, err = call(t, cfg, context.Background(), method, req)
	require.NoError(t, err)
	require.Same(t, req, f.attempts[0].req)
}

// Which answers are retried, how often, and for which methods.
func TestRetryRules(t *testing.T) {
	t.Parallel()
	for _, c := range []codes.Code{codes.Aborted, codes.Unavailable, codes.ResourceExhausted, codes.Internal, codes.Unknown, codes.DeadlineExceeded} {
		require.True(t, grpcretry.DefaultRetry(c), c.String())
	}
	for _, c := range []codes.Code{codes.OK, codes.InvalidArgument, codes.AlreadyExists, codes.FailedPrecondition, codes.NotFound, codes.PermissionDenied, codes.Unimplemented} {
		require.False(t, grpcretry.DefaultRetry(c), c.String())
	}

	f, err := call(t, grpcretry.Config{Backoff: fast}, context.Background(), method, wrapperspb.String("x"), status.Error(codes.InvalidArgument, "no"))
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Len(t, f.attempts, 1, "not retried")

	down := status.Error(codes.Unavailable, "down")
	f, err = call(t, grpcretry.Config{Backoff: fast}, context.Background(), method, wrapperspb.String("x"), down, down, down, down, down)
	require.Equal(t, down, err, "the last answer once the attempts run out")
	require.Len(t, f.attempts, 4, "4 attempts by default")

	f, err = call(t, grpcretry.Config{Backoff: fast, MaxAttempts: 2}, context.Background(), method, wrapperspb.String("x"), down, down)
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.Len(t, f.attempts, 2)

	f, err = call(t, grpcretry.Config{Backoff: fast, Retry: func(c codes.Code) bool { return c == codes.FailedPrecondition }},
		context.Background(), method, wrapperspb.String("x"), status.Error(codes.FailedPrecondition, "later"))
	require.NoError(t, err)
	require.Len(t, f.attempts, 2, "Retry decides")

	f, err = call(t, grpcretry.Config{Backoff: fast, Methods: []string{"/pkg.Service/Other"}}, context.Background(), method, wrapperspb.String("x"), down)
	require.Equal(t, down, err)
	require.Len(t, f.attempts, 1, "a method not listed passes through once")
	require.Empty(t, f.attempts[0].md.Get("idempotency-key"), "and untouched")
}

// The caller's context bounds the waits: a call whose context ends while
// it waits for a RetryInfo delay returns the last answer at once.
func TestContextEndsTheWait(t *testing.T) {
	t.Parallel()
	st, err := status.New(codes.Unavailable, "down").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Hour)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	f, err := call(t, grpcretry.Config{Backoff: backoff.Backoff{Max: time.Hour}}, ctx, method, wrapperspb.String("x"), st.Err())
	require.Equal(t, codes.Unavailable, status.Code(err))
	require.Len(t, f.attempts, 1)
	require.Less(t, time.Since(start), 20*time.Second, "the wait ended with the context, not after the hour")
}
