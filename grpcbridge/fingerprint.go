package grpcbridge

import (
	"fmt"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	fp "github.com/justonce/justonce/internal/fingerprint"
)

// fingerprintVersion is the first byte of every gRPC fingerprint. Change
// it together with the hashed layout: rows stored under another version
// then answer as a mismatch rather than as a false match.
const fingerprintVersion = 1

// fingerprint identifies a call's content: the version byte, then SHA-256
// over fields framed by a fingerprint.Builder with 8-byte lengths
// (fingerprint.Uint64): a tag, the full method name, the request's
// deterministic protobuf encoding (with the idempotency field cleared for
// KeyFromMessage methods), and each of the method's FingerprintMetadata
// keys with its values.
func fingerprint(full string, req any, m *method, md metadata.MD) ([]byte, error) {
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("request %T is not a protobuf message", req)
	}
	if m.Key == KeyFromMessage {
		if fd := msg.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(m.Field)); fd != nil && msg.ProtoReflect().Has(fd) {
			msg = proto.Clone(msg)
			msg.ProtoReflect().Clear(fd)
		}
	}
	body, err := deterministic.Marshal(msg)
	if err != nil {
		return nil, err
	}
	b := fp.NewBuilder(fp.Uint64, "justonce-grpc-fp")
	b.String(full)
	b.Bytes(body)
	for _, k := range m.FingerprintMetadata {
		b.Values(k, md.Get(k))
	}
	return b.Sum(fingerprintVersion), nil
}
