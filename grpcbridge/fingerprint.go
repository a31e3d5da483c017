package grpcbridge

import (
	"fmt"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	fp "github.com/justonce/justonce/internal/fingerprint"
)

// fingerprintVersion is the first byte of every plain gRPC fingerprint
// (detailed ones begin with fingerprint.DetailVersion). Change it together
// with the hashed layout: rows stored under another version then answer
// as a mismatch rather than as a false match.
const fingerprintVersion = fp.PlainVersion

// callFingerprint identifies a call's content: the detailed fingerprint
// (fingerprint.Detailed) of the plain one (fingerprint), with the members "method",
// "metadata:<key>" for each FingerprintMetadata key, and the request
// message's fields as "message:<JSON pointer>" over its JSON mapping
// (protojson, proto field names); or the plain one alone with
// Config.LegacyFingerprints.
func (b *Bridge) callFingerprint(full string, req any, m *method, md metadata.MD) ([]byte, error) {
	msg, body, err := fingerprinted(req, m)
	if err != nil {
		return nil, err
	}
	plain := plainFingerprint(full, body, m, md)
	if b.cfg.LegacyFingerprints {
		return plain, nil
	}
	var ms fp.Members
	ms.Add("method", []byte(full))
	for _, k := range m.FingerprintMetadata {
		ms.AddValues("metadata:"+k, md.Get(k))
	}
	canon, ok := []byte(nil), false
	if j, err := protoJSON.Marshal(msg); err == nil {
		canon, ok = fp.CanonicalJSON(j)
	}
	if ok {
		ms.AddJSON("message", "message:", canon)
	} else {
		ms.Add("message", body)
	}
	return fp.Detailed(plain, &ms), nil
}

// protoJSON is the JSON mapping the members of a message's fingerprint
// are named after: proto field names, fields as set.
var protoJSON = protojson.MarshalOptions{UseProtoNames: true}

// fingerprinted is the request message as fingerprinted (with the
// idempotency field cleared for KeyFromMessage methods) and its
// deterministic encoding.
func fingerprinted(req any, m *method) (proto.Message, []byte, error) {
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, nil, fmt.Errorf("request %T is not a protobuf message", req)
	}
	if m.Key == KeyFromMessage {
		if fd := msg.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(m.Field)); fd != nil && msg.ProtoReflect().Has(fd) {
			msg = proto.Clone(msg)
			msg.ProtoReflect().Clear(fd)
		}
	}
	body, err := deterministic.Marshal(msg)
	return msg, body, err
}

// fingerprint is a call's plain fingerprint (what releases before detailed
// fingerprints stored): the version byte, then SHA-256 over fields framed
// by a fingerprint.Builder with 8-byte lengths (fingerprint.Uint64): a
// tag, the full method name, the request's deterministic protobuf encoding
// (with the idempotency field cleared for KeyFromMessage methods), and
// each of the method's FingerprintMetadata keys with its values.
func fingerprint(full string, req any, m *method, md metadata.MD) ([]byte, error) {
	_, body, err := fingerprinted(req, m)
	if err != nil {
		return nil, err
	}
	return plainFingerprint(full, body, m, md), nil
}

// plainFingerprint is fingerprint of a message's encoding, body.
func plainFingerprint(full string, body []byte, m *method, md metadata.MD) []byte {
	b := fp.NewBuilder(fp.Uint64, "justonce-grpc-fp")
	b.String(full)
	b.Bytes(body)
	for _, k := range m.FingerprintMetadata {
		b.Values(k, md.Get(k))
	}
	return b.Sum(fingerprintVersion)
}
