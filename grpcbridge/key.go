package grpcbridge

import (
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/justonce/justonce/internal/bridgereq"
)

// KeyedRequest is a request message that gives its AEP-155 idempotency
// key itself, for methods with KeyFromMessage. With generated AEP code it
// is three lines in the message's package:
//
//	func (r *CreateBookRequest) IdempotencyKey() (string, *timestamppb.Timestamp) {
//		return r.GetIdempotencyKey().GetKey(), r.GetIdempotencyKey().GetFirstSent()
//	}
//
// Messages without it are read through protoreflect (MethodConfig.Field).
type KeyedRequest interface {
	IdempotencyKey() (key string, firstSent *timestamppb.Timestamp)
}

// keyProblem is a key or first_sent the bridge refuses: InvalidArgument
// with a BadRequest field violation and an ErrorInfo reason.
type keyProblem struct {
	reason string // ErrorInfo reason
	field  string // the metadata key or message field
	msg    string
}

func (p *keyProblem) Error() string { return p.msg }

// Reasons of the ErrorInfo details the bridge answers with.
const (
	reasonMissing    = "IDEMPOTENCY_KEY_MISSING"
	reasonInvalid    = "IDEMPOTENCY_KEY_INVALID"
	reasonReused     = "IDEMPOTENCY_KEY_REUSED"
	reasonInProgress = "REQUEST_IN_PROGRESS"
	reasonFuture     = "FIRST_SENT_IN_FUTURE"
	reasonExpired    = "FIRST_SENT_EXPIRED"
	reasonChanged    = "FIRST_SENT_CHANGED"
	reasonFSInvalid  = "FIRST_SENT_INVALID"
	reasonFSMissing  = "FIRST_SENT_MISSING"
	reasonElsewhere  = "ALREADY_PROCESSED"
	reasonFailed     = "KEY_FAILED"
	reasonGone       = "RESPONSE_EXPIRED"
	reasonStoreDown  = "STORE_UNAVAILABLE"
	reasonOverloaded = "OVERLOADED"
	reasonNotCommit  = "NOT_COMMITTED"
	reasonKeyRate    = "KEY_RATE_EXCEEDED"
)

// parseKey checks a key against a format: printable ASCII (0x20 to 0x7e),
// 1 to maxLen bytes; UUID-only formats also need 8-4-4-4-12 hex digits and
// are lower-cased. It returns the key to record.
func parseKey(s string, f KeyFormat, maxLen int) (string, error) {
	switch {
	case s == "":
		return "", fmt.Errorf("the key is empty")
	case len(s) > maxLen:
		return "", fmt.Errorf("the key is %d bytes; the limit is %d", len(s), maxLen)
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return "", fmt.Errorf("the key has a byte 0x%02x outside printable ASCII at offset %d", s[i], i)
		}
	}
	if f == KeyUUID {
		if !bridgereq.IsUUID(s, false) {
			return "", fmt.Errorf("the key must be a UUID (8-4-4-4-12 hex digits)")
		}
		return strings.ToLower(s), nil
	}
	return s, nil
}

// parseFirstSent parses first_sent from metadata: an RFC 3339 time with a
// zone (nanoseconds allowed), between years 0001 and 9999.
func parseFirstSent(s string) (time.Time, error) {
	if len(s) > 64 {
		return time.Time{}, fmt.Errorf("first_sent is %d bytes long", len(s))
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("first_sent is not an RFC 3339 time")
	}
	return t.UTC(), nil
}

// timestampLimits are those of google.protobuf.Timestamp.
const (
	minTimestamp = -62135596800 // 0001-01-01T00:00:00Z
	maxTimestamp = 253402300799 // 9999-12-31T23:59:59Z
)

// checkFirstSent applies AEP-155's rules. A first_sent later than now +
// skew is in the future. A first_sent earlier than now - (ttl - skew) is
// expired: the ledger keeps a key for ttl from when it first saw it, which
// is no earlier than first_sent - skew, so past that point the key may be
// forgotten and honouring it could run the call twice.
func checkFirstSent(fs, now time.Time, ttl, skew time.Duration, field string) *keyProblem {
	if fs.After(now.Add(skew)) {
		return &keyProblem{reasonFuture, field, fmt.Sprintf(
			"first_sent %s is in the future (server time %s, allowed clock skew %s)",
			fs.Format(time.RFC3339Nano), now.UTC().Format(time.RFC3339), skew)}
	}
	if fs.Before(now.Add(-(ttl - skew))) {
		return &keyProblem{reasonExpired, field, fmt.Sprintf(
			"first_sent %s is expired: keys are honoured for %s (less %s of clock skew); send a new key",
			fs.Format(time.RFC3339Nano), ttl, skew)}
	}
	return nil
}

// callKey is the key of a call, as read.
type callKey struct {
	key       string
	raw       string    // the key as sent, for a masked log line of a refused one
	firstSent time.Time // zero when absent
	keyField  string    // where the key was read, for error details
	fsField   string    // where first_sent was read
}

// keyFromMetadata reads the key and first_sent from the incoming metadata.
// present is false when no key is given.
func (b *Bridge) keyFromMetadata(md metadata.MD, m *method) (ck callKey, present bool, err error) {
	ck.keyField, ck.fsField = b.metadataKey, b.firstSentKey
	keys := md.Get(b.metadataKey)
	if len(keys) == 0 {
		if len(md.Get(b.firstSentKey)) > 0 {
			return ck, false, &keyProblem{reasonInvalid, b.firstSentKey, b.firstSentKey + " is given without " + b.metadataKey}
		}
		return ck, false, nil
	}
	if len(keys) > 1 {
		return ck, false, &keyProblem{reasonInvalid, b.metadataKey, fmt.Sprintf("%s is given %d times", b.metadataKey, len(keys))}
	}
	ck.raw = keys[0]
	if ck.key, err = parseKey(keys[0], m.KeyFormat, m.maxKeyLen); err != nil {
		return ck, false, &keyProblem{reasonInvalid, b.metadataKey, err.Error()}
	}
	switch fs := md.Get(b.firstSentKey); len(fs) {
	case 0:
	case 1:
		if ck.firstSent, err = parseFirstSent(fs[0]); err != nil {
			return ck, false, &keyProblem{reasonFSInvalid, b.firstSentKey, err.Error()}
		}
	default:
		return ck, false, &keyProblem{reasonFSInvalid, b.firstSentKey, fmt.Sprintf("%s is given %d times", b.firstSentKey, len(fs))}
	}
	return ck, true, nil
}

// errNoField: the request message has no usable key field; a server
// configuration error.
type errNoField struct{ msg string }

func (e errNoField) Error() string { return e.msg }

// keyFromMessage reads the AEP-155 field of the request message.
func keyFromMessage(req any, m *method) (ck callKey, present bool, err error) {
	ck.keyField, ck.fsField = m.Field+".key", m.Field+".first_sent"
	var key string
	var ts *timestamppb.Timestamp
	var secs, nanos int64
	hasTS := false
	switch r := req.(type) {
	case KeyedRequest:
		key, ts = r.IdempotencyKey()
		if ts != nil {
			hasTS, secs, nanos = true, ts.GetSeconds(), int64(ts.GetNanos())
		}
	case proto.Message:
		msg := r.ProtoReflect()
		fd := msg.Descriptor().Fields().ByName(protoreflect.Name(m.Field))
		if fd == nil || fd.IsList() || fd.IsMap() {
			return ck, false, errNoField{fmt.Sprintf("request %s has no field %q", msg.Descriptor().FullName(), m.Field)}
		}
		switch fd.Kind() {
		case protoreflect.StringKind:
			key = msg.Get(fd).String()
		case protoreflect.MessageKind:
			if !msg.Has(fd) {
				break
			}
			sub := msg.Get(fd).Message()
			kfd := sub.Descriptor().Fields().ByName("key")
			tfd := sub.Descriptor().Fields().ByName("first_sent")
			if kfd == nil || kfd.Kind() != protoreflect.StringKind || kfd.IsList() {
				return ck, false, errNoField{fmt.Sprintf("field %q of %s has no string field key", m.Field, msg.Descriptor().FullName())}
			}
			key = sub.Get(kfd).String()
			if tfd != nil && tfd.Kind() == protoreflect.MessageKind && tfd.Message().FullName() == "google.protobuf.Timestamp" && sub.Has(tfd) {
				t := sub.Get(tfd).Message()
				tf := t.Descriptor().Fields()
				hasTS = true
				secs = t.Get(tf.ByName("seconds")).Int()
				nanos = t.Get(tf.ByName("nanos")).Int()
			}
		default:
			return ck, false, errNoField{fmt.Sprintf("field %q of %s is neither a string nor an IdempotencyKey message", m.Field, msg.Descriptor().FullName())}
		}
	default:
		return ck, false, errNoField{fmt.Sprintf("request %T is not a protobuf message", req)}
	}
	field := ck.keyField
	if key == "" {
		if hasTS {
			return ck, false, &keyProblem{reasonInvalid, field, ck.fsField + " is set without a key"}
		}
		return ck, false, nil
	}
	ck.raw = key
	if ck.key, err = parseKey(key, m.KeyFormat, m.maxKeyLen); err != nil {
		return ck, false, &keyProblem{reasonInvalid, field, err.Error()}
	}
	if hasTS {
		if ck.firstSent, err = timestampTime(secs, nanos); err != nil {
			return ck, false, &keyProblem{reasonFSInvalid, ck.fsField, err.Error()}
		}
	}
	return ck, true, nil
}

// timestampTime converts a google.protobuf.Timestamp's fields, checking
// its range.
func timestampTime(secs, nanos int64) (time.Time, error) {
	if secs < minTimestamp || secs > maxTimestamp || nanos < 0 || nanos >= 1e9 {
		return time.Time{}, fmt.Errorf("first_sent is not a valid timestamp (seconds %d, nanos %d)", secs, nanos)
	}
	return time.Unix(secs, nanos).UTC(), nil
}
