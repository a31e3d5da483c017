package grpcbridge

import (
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/justonce/justonce/inbox"
)

// How a gRPC answer is kept in an inbox.Result. Code stays 0 so that no
// other front ever takes a gRPC code for an HTTP status.
const (
	resStatus    = ":grpc-status"     // the code, in decimal: marks a gRPC row
	resType      = ":grpc-type"       // the response message's full name (OK)
	resFirstSent = ":grpc-first-sent" // first_sent, RFC 3339, when given
	resHeader    = "h:"               // + header metadata key
	resTrailer   = "t:"               // + trailer metadata key
)

// storedAnswer is a gRPC answer read back from the ledger.
type storedAnswer struct {
	code      codes.Code
	body      []byte // the response message (OK) or a google.rpc.Status
	typeName  string
	header    metadata.MD
	trailer   metadata.MD
	firstSent time.Time
}

var deterministic = proto.MarshalOptions{Deterministic: true}

// encodeResult makes the Result stored for a handler's answer.
func encodeResult(resp any, herr error, hdr, trl metadata.MD, firstSent time.Time) (inbox.Result, error) {
	h := map[string][]string{}
	var body []byte
	st, _ := status.FromError(herr)
	code := st.Code()
	if herr == nil {
		msg, ok := resp.(proto.Message)
		if !ok || msg == nil {
			return inbox.Result{}, fmt.Errorf("grpcbridge: the handler answered %T, not a protobuf message", resp)
		}
		var err error
		if body, err = deterministic.Marshal(msg); err != nil {
			return inbox.Result{}, fmt.Errorf("grpcbridge: marshal the response: %w", err)
		}
		h[resType] = []string{string(msg.ProtoReflect().Descriptor().FullName())}
	} else {
		var err error
		if body, err = deterministic.Marshal(st.Proto()); err != nil {
			return inbox.Result{}, fmt.Errorf("grpcbridge: marshal the status: %w", err)
		}
	}
	h[resStatus] = []string{strconv.Itoa(int(code))}
	if !firstSent.IsZero() {
		h[resFirstSent] = []string{firstSent.Format(time.RFC3339Nano)}
	}
	putMD(h, resHeader, hdr)
	putMD(h, resTrailer, trl)
	return inbox.Result{Header: h, Body: body}, nil
}

// putMD stores metadata; binary values in base64 (the ledger keeps text).
func putMD(h map[string][]string, prefix string, md metadata.MD) {
	for k, vs := range md {
		if strings.HasSuffix(k, "-bin") {
			enc := make([]string, len(vs))
			for i, v := range vs {
				enc[i] = base64.StdEncoding.EncodeToString([]byte(v))
			}
			vs = enc
		}
		h[prefix+k] = append([]string(nil), vs...)
	}
}

// decodeResult reads a gRPC answer back; ok is false for a row another
// front recorded.
func decodeResult(res inbox.Result) (a storedAnswer, ok bool) {
	sc := res.Header[resStatus]
	if res.Code != 0 || len(sc) != 1 {
		return a, false
	}
	n, err := strconv.Atoi(sc[0])
	if err != nil || n < 0 || n > 16 {
		return a, false
	}
	a.code, a.body = codes.Code(n), res.Body
	if t := res.Header[resType]; len(t) == 1 {
		a.typeName = t[0]
	}
	if fs := res.Header[resFirstSent]; len(fs) == 1 {
		a.firstSent, _ = time.Parse(time.RFC3339Nano, fs[0])
	}
	a.header, a.trailer = metadata.MD{}, metadata.MD{}
	for k, vs := range res.Header {
		var md metadata.MD
		switch {
		case strings.HasPrefix(k, resHeader):
			md, k = a.header, k[len(resHeader):]
		case strings.HasPrefix(k, resTrailer):
			md, k = a.trailer, k[len(resTrailer):]
		default:
			continue
		}
		for _, v := range vs {
			if strings.HasSuffix(k, "-bin") {
				b, err := base64.StdEncoding.DecodeString(v)
				if err != nil {
					continue
				}
				v = string(b)
			}
			md[k] = append(md[k], v)
		}
	}
	return a, true
}

// answer returns what the interceptor answers for a stored answer: the
// response message (decoded into its registered type, else carried as
// raw bytes so that it still reaches the client byte for byte) or the
// stored status with its details.
func (a storedAnswer) answer() (any, error) {
	if a.code != codes.OK {
		var sp spb.Status
		if err := proto.Unmarshal(a.body, &sp); err != nil {
			return nil, status.Error(codes.Internal, "grpcbridge: the stored status cannot be read")
		}
		return nil, status.FromProto(&sp).Err()
	}
	if mt, err := protoregistry.GlobalTypes.FindMessageByName(protoreflect.FullName(a.typeName)); err == nil {
		msg := mt.New().Interface()
		if err := proto.Unmarshal(a.body, msg); err == nil {
			return msg, nil
		}
	}
	raw := &emptypb.Empty{}
	raw.ProtoReflect().SetUnknown(protoreflect.RawFields(a.body))
	return raw, nil
}

// bufferedStream holds the header and trailer metadata a handler sets
// until the bridge knows the outcome: they reach the client with the
// response, after the commit, and are stored with it.
type bufferedStream struct {
	method  string
	mu      sync.Mutex
	header  metadata.MD
	trailer metadata.MD
}

var _ grpc.ServerTransportStream = (*bufferedStream)(nil)

func (s *bufferedStream) Method() string { return s.method }

func (s *bufferedStream) SetHeader(md metadata.MD) error {
	s.mu.Lock()
	s.header = metadata.Join(s.header, md)
	s.mu.Unlock()
	return nil
}

func (s *bufferedStream) SendHeader(md metadata.MD) error { return s.SetHeader(md) }

func (s *bufferedStream) SetTrailer(md metadata.MD) error {
	s.mu.Lock()
	s.trailer = metadata.Join(s.trailer, md)
	s.mu.Unlock()
	return nil
}

func (s *bufferedStream) metadata() (hdr, trl metadata.MD) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.header.Copy(), s.trailer.Copy()
}
