package grpcbridge

import (
	"strings"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"
)

// ErrorDomain is the domain of the ErrorInfo details the bridge answers
// with; their reasons are listed in the package documentation.
const ErrorDomain = "justonce"

func errorInfo(reason string, md map[string]string) *errdetails.ErrorInfo {
	return &errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain, Metadata: md}
}

func badRequest(field, desc string) *errdetails.BadRequest {
	return &errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: field, Description: desc}}}
}

func withDetails(code codes.Code, msg string, details ...protoadapt.MessageV1) error {
	st, err := status.New(code, msg).WithDetails(details...)
	if err != nil {
		return status.Error(code, msg)
	}
	return st.Err()
}

// invalidKey answers a missing or refused key or first_sent.
func invalidKey(p *keyProblem) error {
	return withDetails(codes.InvalidArgument, p.msg, errorInfo(p.reason, nil), badRequest(p.field, p.msg))
}

// retryable answers a condition a retry with the same key may clear.
func (b *Bridge) retryable(code codes.Code, reason, msg string) error {
	return withDetails(code, msg, errorInfo(reason, nil), &errdetails.RetryInfo{RetryDelay: durationpb.New(b.cfg.RetryAfter)})
}

// reused answers a key reused with another request: InvalidArgument with
// IDEMPOTENCY_KEY_REUSED, whose ErrorInfo metadata "differences" lists what
// differs (comma-separated), and a BadRequest violation for the key and
// one for each difference.
func reused(ck callKey, diff []string) error {
	msg := "this key was used with a different request (method, message or metadata); use a new key for a new request"
	var md map[string]string
	br := badRequest(ck.keyField, "reused with a different request")
	if len(diff) > 0 {
		msg = "this key was used with a different request (it differs in " + strings.Join(diff, ", ") +
			"); use a new key for a new request"
		md = map[string]string{"differences": strings.Join(diff, ",")}
		for _, d := range diff {
			br.FieldViolations = append(br.FieldViolations, &errdetails.BadRequest_FieldViolation{
				Field: d, Description: "differs from the request first sent with this key"})
		}
	}
	return withDetails(codes.InvalidArgument, msg, errorInfo(reasonReused, md), br)
}
