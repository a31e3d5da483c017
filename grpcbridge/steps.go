package grpcbridge

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// Steps returns the *inbox.Steps of a steps method's call
// (MethodConfig.Steps), and nil elsewhere. The handler records its work
// with them: Steps.Tx for a Postgres step (exactly once), Steps.Call for
// an outside one (at least once, with its own key, inbox.StepKey, to pass
// on as the outside service's idempotency key), Steps.Compensate for how
// to undo a step should the call fail for good (an error marked
// inbox.Permanent).
func Steps(ctx context.Context) *inbox.Steps { return inbox.StepsFrom(ctx) }

// serveSteps runs a keyed call of a steps method under
// inbox.Ledger.DoSteps; hctx is the handler's context.
func (b *Bridge) serveSteps(ctx, hctx context.Context, md metadata.MD, r inbox.Request, ck callKey, m *method, req any, handler grpc.UnaryHandler, bs *bufferedStream) (any, error) {
	var resp any
	var herr error
	var pv *panicked
	ran := false
	run := func(ctx context.Context, st *inbox.Steps) (inbox.Result, error) {
		ran = true
		resp, pv, herr = run(bridgereq.WithFencingToken(ctx, st.Token()), req, handler)
		switch {
		case pv != nil:
			return inbox.Result{}, errPanicked // the steps recorded stay
		case errors.Is(herr, inbox.ErrPermanent):
			return inbox.Result{}, herr
		case !m.Store(status.Code(herr)):
			return inbox.Result{}, errNotStored // the steps recorded stay
		}
		hdr, trl := bs.metadata()
		res, err := encodeResult(resp, herr, b.stored(hdr), b.stored(trl), ck.firstSent)
		if err != nil {
			// The steps' effects happened and the answer cannot be
			// stored: fail for good, compensating.
			return inbox.Result{}, inbox.Permanent(fmt.Errorf("%w: %w", errEncode, err))
		}
		return res, nil
	}
	out, err := b.cfg.Ledger.DoSteps(hctx, r, m.LeaseDuration, run)
	if err == nil && !ran && bridgereq.PlainRetry(out, &r) {
		out, err = b.cfg.Ledger.DoSteps(hctx, r, m.LeaseDuration, run)
	}
	switch {
	case pv != nil:
		b.log.ErrorContext(ctx, "justonce/grpcbridge: handler panicked; the steps recorded stay", "key", r.Key.String(),
			"panic", fmt.Sprint(pv.value), "stack", string(pv.stack))
		panic(pv.value)
	case errors.Is(err, errNotStored):
		b.log.DebugContext(ctx, "justonce/grpcbridge: status not stored; the steps recorded stay for a retry", "key", r.Key.String(), "code", status.Code(herr).String())
		b.flush(ctx, bs)
		return resp, herr
	case errors.Is(err, errEncode):
		b.log.ErrorContext(ctx, "justonce/grpcbridge: answer not storable; compensated, key failed", "key", r.Key.String(), "err", err)
		return nil, status.Error(codes.Internal, "the answer cannot be stored; the operation failed for good under this key")
	case ran && herr != nil && errors.Is(err, inbox.ErrPermanent):
		b.log.InfoContext(ctx, "justonce/grpcbridge: steps failed for good; compensated, key failed", "key", r.Key.String(), "err", err)
		b.flush(ctx, bs)
		return resp, herr
	case errors.Is(err, inbox.ErrLeaseLost):
		b.log.ErrorContext(ctx, "justonce/grpcbridge: lease lost while the handler ran", "key", r.Key.String(), "err", err)
		return nil, status.Error(codes.Internal, "the handler outlived its lease; another attempt may have taken the key over")
	case err != nil:
		return nil, b.failure(r, err)
	}
	return b.done(ctx, md, req, r, ck, m, out, bs, resp, herr)
}
