package grpcbridge

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"strings"
	"testing"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/justonce/justonce/harness/grpctest/testpb"
)

// TestFingerprintGolden pins the fingerprint bytes. They are stored in the
// ledger: if any of these change, a retry of a key recorded before the
// upgrade answers as a mismatch. Change them only together with
// fingerprintVersion.
func TestFingerprintGolden(t *testing.T) {
	const full = "/justonce.test.Orders/CreateOrder"
	long := strings.Repeat("é-long value ", 40) // lengths above 127 and 255
	for _, c := range []struct {
		name string
		full string
		req  proto.Message
		mc   MethodConfig
		md   metadata.MD
		want string
	}{
		{
			name: "empty message",
			full: full,
			req:  &testpb.CreateOrderRequest{},
			want: "01fcb0525d2b06692d93cfedbd755d4e42bf51a8e037c532cc5312de3687227277",
		},
		{
			name: "fields",
			full: full,
			req:  &testpb.CreateOrderRequest{Item: "book", Quantity: 3, Tags: []string{"b", "a", "ü"}},
			want: "01e372403ac42f1e25bbb49d8c4e2340dcd000c8622892b200eff3cf19915ca4df",
		},
		{
			name: "other method",
			full: "/justonce.test.Orders/Other",
			req:  &testpb.CreateOrderRequest{Item: "book", Quantity: 3, Tags: []string{"b", "a", "ü"}},
			want: "0110cbe31fd5c9c653f892225134094019741b9fa1bd9f757d5f461e206eec1e54",
		},
		{
			name: "long body",
			full: full,
			req:  &testpb.CreateOrderRequest{Item: long, Quantity: -1, Tags: []string{long, ""}},
			want: "01a6da88512250b18e17b6bbd6739f6755af93a76584b44a4e84c613e64890f106",
		},
		{
			name: "metadata",
			full: full,
			req:  &testpb.CreateOrderRequest{Item: "book"},
			mc:   MethodConfig{FingerprintMetadata: []string{"api-version", "x-tenant", "absent"}},
			md:   metadata.Pairs("api-version", "2", "x-tenant", "acme", "x-tenant", long, "ignored", "x"),
			want: "01b4619a0fe9390667ad3e94308ddd80dcf41e89949b1196a79d579b51ff3b52f9",
		},
		{
			name: "key in message cleared",
			full: full,
			req: &testpb.CreateOrderRequest{Item: "book", Quantity: 1, IdempotencyKey: &testpb.IdempotencyKey{
				Key: "k-1", FirstSent: timestamppb.New(timestamppb.Now().AsTime()),
			}},
			mc:   MethodConfig{Key: KeyFromMessage},
			want: "01f891f4dc08a8fa9269088047715add515a638aac94a0e95a44f94bd2ae0a2279",
		},
		{
			name: "key in message, none given",
			full: full,
			req:  &testpb.CreateOrderRequest{Item: "book", Quantity: 1},
			mc:   MethodConfig{Key: KeyFromMessage},
			want: "01f891f4dc08a8fa9269088047715add515a638aac94a0e95a44f94bd2ae0a2279",
		},
		{
			name: "key in another field",
			full: full,
			req:  &testpb.CreateOrderRequest{Item: "k-2", Quantity: 1},
			mc:   MethodConfig{Key: KeyFromMessage, Field: "item"},
			md:   metadata.Pairs("api-version", "2"),
			want: "01ec658df14d41e31969eb6a42d0b67f638658e115ed8486d25e7a73b4f10d8537",
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := proto.Clone(c.req)
			got, err := fingerprint(c.full, c.req, newMethod(c.mc, &Config{}), c.md)
			if err != nil {
				t.Fatal(err)
			}
			if h := hex.EncodeToString(got); h != c.want {
				t.Errorf("fingerprint = %s\nwant            %s", h, c.want)
			}
			if len(got) != 33 || got[0] != fingerprintVersion {
				t.Errorf("fingerprint is %d bytes starting %d; want 33 starting with the version", len(got), got[0])
			}
			if !proto.Equal(before, c.req) {
				t.Error("fingerprint changed the request")
			}
		})
	}
	if _, err := fingerprint(full, "not a message", newMethod(MethodConfig{}, &Config{}), nil); err == nil {
		t.Error("a request that is not a protobuf message was fingerprinted")
	}
}

// TestFingerprintLayout rebuilds one fingerprint by hand from the layout
// fingerprint documents: lengths and counts are 8-byte big-endian.
func TestFingerprintLayout(t *testing.T) {
	const full = "/justonce.test.Orders/CreateOrder"
	req := &testpb.CreateOrderRequest{Item: "book", Quantity: 2}
	md := metadata.Pairs("api-version", "2", "api-version", "3")
	got, err := fingerprint(full, req, newMethod(MethodConfig{FingerprintMetadata: []string{"api-version", "absent"}}, &Config{}), md)
	if err != nil {
		t.Fatal(err)
	}
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	var in []byte
	n := func(n int) { in = binary.BigEndian.AppendUint64(in, uint64(n)) }
	f := func(b []byte) { n(len(b)); in = append(in, b...) }
	f([]byte("justonce-grpc-fp"))
	f([]byte(full))
	f(body)
	f([]byte("api-version"))
	n(2)
	f([]byte("2"))
	f([]byte("3"))
	f([]byte("absent"))
	n(0)
	sum := sha256.Sum256(in)
	if want := append([]byte{1}, sum[:]...); !bytes.Equal(got, want) {
		t.Errorf("fingerprint = %x\nwant            %x", got, want)
	}
}
