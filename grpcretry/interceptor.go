// Package grpcretry is the client side of gRPC idempotency keys: a unary
// client interceptor that gives each call without a key a UUID v4 key and
// first_sent, and retries retryable codes with the same key and
// first_sent, honouring the server's RetryInfo. It follows AEP-155: a
// request message with an idempotency field (an aep.api.IdempotencyKey
// shaped message with a key and a first_sent Timestamp, or a string) gets
// the key there, on a copy; any other request gets it in metadata. It
// fits the server interceptor of package grpcbridge, and any server that
// reads the same metadata or field.
//
// It depends only on gRPC, protobuf and package backoff, so a client
// program does not link the ledger's database drivers. Package httpretry
// is its HTTP counterpart.
package grpcretry

import (
	"context"
	"time"

	"github.com/google/uuid"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/justonce/justonce/backoff"
)

// Wire names the interceptor writes, the defaults grpcbridge reads.
const (
	// DefaultMetadataKey is the request metadata carrying the key.
	DefaultMetadataKey = "idempotency-key"
	// DefaultFirstSentKey is the request metadata carrying first_sent (RFC
	// 3339) when the key is in metadata.
	DefaultFirstSentKey = "idempotency-first-sent"
	// DefaultField is the request message field of AEP-155.
	DefaultField = "idempotency_key"
)

// DefaultBackoffMax is the longest wait between attempts, and the cap of a
// RetryInfo delay, when Config.Backoff.Max is unset: 5 s, shorter than the
// runtime's 30 s (consumer.DefaultBackoffMax) as a caller is waiting.
const DefaultBackoffMax = 5 * time.Second

// Config configures UnaryClientInterceptor. The zero value is ready to
// use.
type Config struct {
	// MetadataKey and FirstSentKey name the metadata the key and
	// first_sent go in, for requests without an AEP-155 field. Defaults
	// "idempotency-key" and "idempotency-first-sent".
	MetadataKey  string
	FirstSentKey string
	// Field names the AEP-155 request field (an IdempotencyKey message or
	// a string). A request that has it gets the key there, on a copy; the
	// caller's message is not changed. Default "idempotency_key".
	Field string
	// MaxAttempts, the first included. Default 4.
	MaxAttempts int
	// Backoff between attempts. A RetryInfo delay in the answer is
	// honoured instead, up to Backoff.Max. Unset fields: 100 ms,
	// DefaultBackoffMax (5 s), multiplier 2.
	Backoff backoff.Backoff
	// Retry says which codes are retried with the same key. Nil:
	// DefaultRetry.
	Retry func(codes.Code) bool
	// NewKey makes a key. Default: a random UUID v4.
	NewKey func() string
	// Methods, when set, limits the interceptor to these full method
	// names; other calls pass through once, untouched.
	Methods []string
}

// DefaultRetry retries the codes a server answers when the call did not
// run or was not recorded, so that a retry with the same key is safe and
// may succeed: Aborted (in flight), Unavailable, ResourceExhausted,
// Internal, Unknown and DeadlineExceeded (while the caller's own context
// is still alive).
func DefaultRetry(c codes.Code) bool {
	switch c {
	case codes.Aborted, codes.Unavailable, codes.ResourceExhausted, codes.Internal, codes.Unknown, codes.DeadlineExceeded:
		return true
	}
	return false
}

// UnaryClientInterceptor returns a client interceptor that gives each call
// without a key a UUID v4 key and first_sent (in the request's AEP-155
// field when it has one, else in metadata) and retries retryable codes
// with the same key and first_sent:
//
//	conn, err := grpc.NewClient(addr, grpc.WithUnaryInterceptor(grpcretry.UnaryClientInterceptor(grpcretry.Config{})))
//
// A key the caller set (in the field or the metadata) is kept; a request
// with a key in metadata is not changed.
func UnaryClientInterceptor(cfg Config) grpc.UnaryClientInterceptor {
	cfg = cfg.withDefaults()
	var only map[string]bool
	if len(cfg.Methods) > 0 {
		only = map[string]bool{}
		for _, m := range cfg.Methods {
			only[m] = true
		}
	}
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if only != nil && !only[method] {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		req, ctx = cfg.withKey(ctx, req)
		for attempt := 1; ; attempt++ {
			err := invoker(ctx, method, req, reply, cc, opts...)
			code := status.Code(err)
			if err == nil || attempt >= cfg.MaxAttempts || !cfg.Retry(code) || ctx.Err() != nil {
				return err
			}
			if backoff.Sleep(ctx, cfg.wait(attempt, err)) != nil {
				return err
			}
		}
	}
}

// withDefaults is cfg with its unset fields at their defaults.
func (cfg Config) withDefaults() Config {
	cfg.MetadataKey = or(cfg.MetadataKey, DefaultMetadataKey)
	cfg.FirstSentKey = or(cfg.FirstSentKey, DefaultFirstSentKey)
	cfg.Field = or(cfg.Field, DefaultField)
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 4
	}
	cfg.Backoff = cfg.Backoff.Or(backoff.Backoff{Max: DefaultBackoffMax})
	if cfg.Retry == nil {
		cfg.Retry = DefaultRetry
	}
	if cfg.NewKey == nil {
		cfg.NewKey = uuid.NewString
	}
	return cfg
}

// wait is the wait after failed attempt n (from 1) that answered err: its
// RetryInfo delay when it has one, else the backoff's, at most Backoff.Max.
func (cfg *Config) wait(n int, err error) time.Duration {
	if d, ok := retryDelay(err); ok {
		return min(d, cfg.Backoff.Max)
	}
	return cfg.Backoff.Delay(n)
}

func or[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// withKey gives req a key when it has none: in its AEP-155 field, on a
// copy, or else in the outgoing metadata.
func (cfg *Config) withKey(ctx context.Context, req any) (any, context.Context) {
	now := time.Now().UTC()
	md, _ := metadata.FromOutgoingContext(ctx)
	if len(md.Get(cfg.MetadataKey)) > 0 {
		return req, ctx // the caller gave the key in metadata
	}
	if msg, ok := req.(proto.Message); ok {
		fd := msg.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(cfg.Field))
		if fd != nil && !fd.IsList() && !fd.IsMap() {
			switch fd.Kind() {
			case protoreflect.StringKind:
				if msg.ProtoReflect().Get(fd).String() == "" {
					msg = proto.Clone(msg)
					msg.ProtoReflect().Set(fd, protoreflect.ValueOfString(cfg.NewKey()))
				}
				return msg, ctx
			case protoreflect.MessageKind:
				if k := aepKey(msg, fd); k != nil {
					return k(cfg.NewKey(), now), ctx
				}
				return msg, ctx
			}
		}
	}
	return req, metadata.AppendToOutgoingContext(ctx, cfg.MetadataKey, cfg.NewKey(), cfg.FirstSentKey, now.Format(time.RFC3339Nano))
}

// aepKey returns a func that fills an empty IdempotencyKey field (key and
// first_sent) on a copy of msg, or nil when the field has a key already
// or is not of that shape.
func aepKey(msg proto.Message, fd protoreflect.FieldDescriptor) func(key string, now time.Time) proto.Message {
	kfd := fd.Message().Fields().ByName("key")
	tfd := fd.Message().Fields().ByName("first_sent")
	if kfd == nil || kfd.Kind() != protoreflect.StringKind || kfd.IsList() {
		return nil
	}
	if msg.ProtoReflect().Has(fd) && msg.ProtoReflect().Get(fd).Message().Get(kfd).String() != "" {
		return nil
	}
	return func(key string, now time.Time) proto.Message {
		c := proto.Clone(msg)
		sub := c.ProtoReflect().Mutable(fd).Message()
		sub.Set(kfd, protoreflect.ValueOfString(key))
		if tfd != nil && tfd.Kind() == protoreflect.MessageKind && tfd.Message().FullName() == "google.protobuf.Timestamp" && !sub.Has(tfd) {
			ts := timestamppb.New(now)
			t := sub.Mutable(tfd).Message()
			tf := tfd.Message().Fields()
			t.Set(tf.ByName("seconds"), protoreflect.ValueOfInt64(ts.Seconds))
			t.Set(tf.ByName("nanos"), protoreflect.ValueOfInt32(ts.Nanos))
		}
		return c
	}
}

// retryDelay returns the RetryInfo delay of an error status.
func retryDelay(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}
