package grpcbridge

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/justonce/justonce/inbox"
)

// StaleInfo describes a retry whose operation ran but whose stored answer
// is gone (MethodConfig.ResultTTL): what MethodConfig.StaleResponse is
// given to find the resource's current state.
type StaleInfo struct {
	// Method is the call's full method name.
	Method string
	// Key is the client's idempotency key, as sent.
	Key string
	// Tenant is the call's tenant (Config.Tenant), "" without one.
	Tenant string
	// CompletedAt is when the operation completed.
	CompletedAt time.Time
	// KeyExpiresAt is when the key itself expires (the expiry trailer
	// says it too).
	KeyExpiresAt time.Time
}

// stale answers a retry whose stored answer passed its clock: the
// method's StaleResponse, else AlreadyExists with RESPONSE_EXPIRED, whose
// ErrorInfo metadata "completed_at" says when the operation completed.
func (b *Bridge) stale(ctx context.Context, md metadata.MD, req any, m *method, r inbox.Request, ck callKey, rec *inbox.Record) (any, error) {
	_ = grpc.SetHeader(ctx, metadata.Pairs(b.replayHeader, "true"))
	if m.StaleResponse != nil {
		full, _ := grpc.Method(ctx)
		resp, err := m.StaleResponse(ctx, req, StaleInfo{Method: full, Key: ck.key, Tenant: r.Tenant,
			CompletedAt: rec.CompletedAt, KeyExpiresAt: rec.ExpiresAt})
		if resp != nil || err != nil {
			b.log.InfoContext(ctx, "justonce/grpcbridge: stale answer from the method's hook", b.attrs(ctx, md, "key", r.Key.String())...)
			return resp, err
		}
	}
	b.log.InfoContext(ctx, "justonce/grpcbridge: stored answer expired", b.attrs(ctx, md, "key", r.Key.String())...)
	meta := map[string]string{}
	if !rec.CompletedAt.IsZero() {
		meta["completed_at"] = rec.CompletedAt.UTC().Format(time.RFC3339)
	}
	return nil, withDetails(codes.AlreadyExists,
		"the operation for this key ran and its answer is no longer kept; it will not run again under this key: "+
			"fetch the resource's current state instead",
		errorInfo(reasonGone, meta))
}
