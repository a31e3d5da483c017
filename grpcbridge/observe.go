package grpcbridge

import (
	"context"
	"errors"
	"log/slog"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// observeMessages are the log messages of observe mode, by Would value.
var observeMessages = map[string]string{
	bridgereq.WouldRun:              "justonce/grpcbridge: observe mode: new key, would run",
	bridgereq.WouldReplay:           "justonce/grpcbridge: observe mode: duplicate, would replay the stored answer",
	bridgereq.WouldRefuseMissingKey: "justonce/grpcbridge: observe mode: missing key, would refuse (InvalidArgument)",
	bridgereq.WouldRefuseInvalidKey: "justonce/grpcbridge: observe mode: invalid key, would refuse (InvalidArgument)",
	bridgereq.WouldConflict:         "justonce/grpcbridge: observe mode: key in flight, would answer Aborted",
	bridgereq.WouldMismatch:         "justonce/grpcbridge: observe mode: key reused with another request, would answer InvalidArgument",
}

// observe serves a call of an observe-mode method: the handler gets it as
// it came, on the call's own context, while the ledger records its key and
// fingerprint (under a lease, as the handler runs outside any transaction
// of the bridge's) and the log and OnObserve say what enforcing would have
// done.
func (b *Bridge) observe(ctx context.Context, req any, full string, m *method, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	ck, present, err := b.readKey(req, md, m)
	var kp *keyProblem
	switch {
	case errors.As(err, &kp):
		b.observed(ctx, md, full, bridgereq.WouldRefuseInvalidKey, slog.LevelWarn, "reason", kp.msg, "key", inbox.Mask(ck.raw))
		return handler(ctx, req)
	case err != nil:
		b.log.ErrorContext(ctx, "justonce/grpcbridge: observe mode: method misconfigured", "method", full, "err", err)
		return handler(ctx, req)
	case !present:
		if m.Required {
			b.observed(ctx, md, full, bridgereq.WouldRefuseMissingKey, slog.LevelWarn)
		}
		return handler(ctx, req)
	}
	if p := b.checkFirstSent(ck, m); p != nil {
		b.observed(ctx, md, full, bridgereq.WouldRefuseInvalidKey, slog.LevelWarn, "reason", p.msg, "key", inbox.Mask(ck.key))
		return handler(ctx, req)
	}
	fp, err := b.callFingerprint(full, req, m, md)
	if err != nil {
		b.log.ErrorContext(ctx, "justonce/grpcbridge: observe mode: fingerprint", "method", full, "err", err)
		return handler(ctx, req)
	}
	r, err := m.spec.Request(b.cfg.Ledger, ck.key, fp, bridgereq.Call(b.cfg.Tenant, ctx), bridgereq.Call(b.cfg.Principal, ctx))
	if err != nil {
		var ke *bridgereq.KeyError
		if errors.As(err, &ke) {
			b.observed(ctx, md, full, bridgereq.WouldRefuseInvalidKey, slog.LevelWarn, "reason", ke.Error(), "key", inbox.Mask(ck.key))
		} else {
			b.log.ErrorContext(ctx, "justonce/grpcbridge: observe mode: key rejected by the ledger", "key", r.Key.String(), "err", err)
		}
		return handler(ctx, req)
	}
	r.LockWait = 0 // never hold the call back

	// The ledger's work does not end with the client's call.
	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), b.cfg.HandlerTimeout)
	defer cancel()
	lease, out, err := b.cfg.Ledger.AcquireLease(lctx, r, b.cfg.HandlerTimeout)
	if err == nil && lease == nil && bridgereq.PlainRetry(out, &r) {
		lease, out, err = b.cfg.Ledger.AcquireLease(lctx, r, b.cfg.HandlerTimeout)
	}
	switch {
	case err != nil:
		b.log.WarnContext(ctx, "justonce/grpcbridge: observe mode: store unavailable, nothing observed", "key", r.Key.String(), "err", err)
		return handler(ctx, req)
	case lease == nil:
		would := bridgereq.Would(out, Source)
		kv := []any{"key", r.Key.String()}
		if would == bridgereq.WouldMismatch {
			kv = append(kv, "differences", bridgereq.Differences(out, r.Fingerprint))
		}
		b.observed(ctx, md, full, would, slog.LevelInfo, kv...)
		return handler(ctx, req)
	}
	b.observed(ctx, md, full, bridgereq.WouldRun, slog.LevelDebug, "key", r.Key.String())
	done := false
	defer func() {
		if !done { // the handler panicked: the key is free, as enforcing would leave it
			_ = lease.Abandon(lctx)
		}
	}()
	resp, herr := handler(ctx, req)
	done = true
	if m.Store(status.Code(herr)) {
		err = lease.Complete(lctx, inbox.Result{})
	} else {
		err = lease.Abandon(lctx)
	}
	if err != nil {
		b.log.DebugContext(ctx, "justonce/grpcbridge: observe mode: key not recorded", "key", r.Key.String(), "err", err)
	}
	return resp, herr
}

// observed tells OnObserve and the log what enforcing would have done.
func (b *Bridge) observed(ctx context.Context, md metadata.MD, full, would string, level slog.Level, kv ...any) {
	if f := b.cfg.OnObserve; f != nil {
		f(full, would)
	}
	b.log.Log(ctx, level, observeMessages[would], b.attrs(ctx, md, append([]any{"method", full, "would", would}, kv...)...)...)
}
