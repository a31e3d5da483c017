package grpcbridge

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// fingerprintVersion is the first byte of every gRPC fingerprint. Change
// it together with the hashed layout: rows stored under another version
// then answer as a mismatch rather than as a false match.
const fingerprintVersion = 1

// fingerprint identifies a call's content: the version byte, then SHA-256
// over length-prefixed fields: a tag, the full method name, the request's
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
	h := sha256.New()
	field(h, []byte("justonce-grpc-fp"))
	field(h, []byte(full))
	field(h, body)
	for _, k := range m.FingerprintMetadata {
		vs := md.Get(k)
		field(h, []byte(k))
		writeLen(h, len(vs))
		for _, v := range vs {
			field(h, []byte(v))
		}
	}
	return h.Sum([]byte{fingerprintVersion}), nil
}

func field(h hash.Hash, b []byte) {
	writeLen(h, len(b))
	h.Write(b)
}

func writeLen(h hash.Hash, n int) {
	var buf [8]byte
	binary.BigEndian.PutUint64(buf[:], uint64(n))
	h.Write(buf[:])
}
