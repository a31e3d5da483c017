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
	"errors"
	"fmt"
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
	// DefaultExpiresKey is the trailer metadata in which the server says
	// until when it remembers the key (RFC 3339).
	DefaultExpiresKey = "idempotency-key-expires"
)

// ExpiryMargin is how long before the key's expiry the interceptor stops
// retrying with it: a retry must reach the server before the key expires.
// The expiry is on the server's clock and compared with the client's;
// first_sent, which the interceptor sends with every key it makes, lets
// the server refuse a key its clock has expired (FIRST_SENT_EXPIRED),
// which the interceptor also reports as an unknown outcome.
const ExpiryMargin = time.Second

// ErrOutcomeUnknown: a call was not retried because its key had expired
// (or would have by the time of the retry) on the server, which would then
// have run it as a new call, or the server refused a retry because the
// key's first_sent had expired; whether the earlier attempts' operation
// happened is unknown. The error is an *OutcomeUnknownError. Find out from
// the resource itself, then call again, if need be, with a new key.
var ErrOutcomeUnknown = errors.New("grpcretry: the key expired before the outcome was known")

// OutcomeUnknownError is the error of a call not retried because its key
// expired. It matches ErrOutcomeUnknown and unwraps to the last attempt's
// error (a status: status.Code gives its code, so match
// ErrOutcomeUnknown before reading codes).
type OutcomeUnknownError struct {
	// Key is the call's idempotency key.
	Key string
	// Expires is when the server said the key expires, on the server's
	// clock; zero when the server refused the key's first_sent instead.
	Expires time.Time
	// Err is the last attempt's error, the last answer.
	Err error
}

// Error names the key, its expiry and the last attempt's answer.
func (e *OutcomeUnknownError) Error() string {
	at := "its first_sent expired"
	if !e.Expires.IsZero() {
		at = "it expired at " + e.Expires.UTC().Format(time.RFC3339)
	}
	return fmt.Sprintf("grpcretry: key %s: %s before the outcome was known (last attempt: %v)", e.Key, at, e.Err)
}

// Is makes an *OutcomeUnknownError match ErrOutcomeUnknown.
func (e *OutcomeUnknownError) Is(target error) bool { return target == ErrOutcomeUnknown }

// Unwrap returns the last attempt's error.
func (e *OutcomeUnknownError) Unwrap() error { return e.Err }

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
	// ExpiresKey names the trailer metadata in which the server says until
	// when it remembers the key (RFC 3339); once that time is near, the
	// key is not sent again and the call fails with ErrOutcomeUnknown.
	// Default DefaultExpiresKey, the one grpcbridge sends.
	ExpiresKey string
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
		req, ctx, key := cfg.withKey(ctx, req)
		var expires time.Time
		for attempt := 1; ; attempt++ {
			var trailer metadata.MD
			err := invoker(ctx, method, req, reply, cc, append(opts[:len(opts):len(opts)], grpc.Trailer(&trailer))...)
			if v := trailer.Get(cfg.ExpiresKey); len(v) > 0 {
				if at, perr := time.Parse(time.RFC3339Nano, v[0]); perr == nil {
					expires = at
				}
			}
			if attempt > 1 && firstSentExpired(err) {
				// The server would not honour the key any more: the
				// earlier attempts' outcome is unknown.
				return &OutcomeUnknownError{Key: key, Err: err}
			}
			code := status.Code(err)
			if err == nil || attempt >= cfg.MaxAttempts || !cfg.Retry(code) || ctx.Err() != nil {
				return err
			}
			wait := cfg.wait(attempt, err)
			if !expires.IsZero() && !time.Now().Add(wait+ExpiryMargin).Before(expires) {
				return &OutcomeUnknownError{Key: key, Expires: expires, Err: err}
			}
			if backoff.Sleep(ctx, wait) != nil {
				return err
			}
		}
	}
}

// firstSentExpired reports the server's refusal of a key whose first_sent
// is past its TTL (grpcbridge's FIRST_SENT_EXPIRED).
func firstSentExpired(err error) bool {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.InvalidArgument {
		return false
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == "FIRST_SENT_EXPIRED" {
			return true
		}
	}
	return false
}

// withDefaults is cfg with its unset fields at their defaults.
func (cfg Config) withDefaults() Config {
	cfg.MetadataKey = or(cfg.MetadataKey, DefaultMetadataKey)
	cfg.FirstSentKey = or(cfg.FirstSentKey, DefaultFirstSentKey)
	cfg.Field = or(cfg.Field, DefaultField)
	cfg.ExpiresKey = or(cfg.ExpiresKey, DefaultExpiresKey)
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
// copy, or else in the outgoing metadata. It returns the call's key too.
func (cfg *Config) withKey(ctx context.Context, req any) (any, context.Context, string) {
	now := time.Now().UTC()
	md, _ := metadata.FromOutgoingContext(ctx)
	if keys := md.Get(cfg.MetadataKey); len(keys) > 0 {
		return req, ctx, keys[0] // the caller gave the key in metadata
	}
	if msg, ok := req.(proto.Message); ok {
		fd := msg.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(cfg.Field))
		if fd != nil && !fd.IsList() && !fd.IsMap() {
			switch fd.Kind() {
			case protoreflect.StringKind:
				key := msg.ProtoReflect().Get(fd).String()
				if key == "" {
					key = cfg.NewKey()
					msg = proto.Clone(msg)
					msg.ProtoReflect().Set(fd, protoreflect.ValueOfString(key))
				}
				return msg, ctx, key
			case protoreflect.MessageKind:
				if k := aepKey(msg, fd); k != nil {
					key := cfg.NewKey()
					return k(key, now), ctx, key
				}
				if kfd := fd.Message().Fields().ByName("key"); kfd != nil && kfd.Kind() == protoreflect.StringKind && msg.ProtoReflect().Has(fd) {
					return msg, ctx, msg.ProtoReflect().Get(fd).Message().Get(kfd).String()
				}
				return msg, ctx, ""
			}
		}
	}
	key := cfg.NewKey()
	return req, metadata.AppendToOutgoingContext(ctx, cfg.MetadataKey, key, cfg.FirstSentKey, now.Format(time.RFC3339Nano)), key
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
