package httpbridge

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// Steps returns the *inbox.Steps of a steps route's request
// (RouteConfig.Steps), and nil elsewhere. The handler records its work
// with them: Steps.Tx for a Postgres step (exactly once), Steps.Call for
// an outside one (at least once, with its own key, inbox.StepKey, to pass
// on as the outside service's idempotency key), Steps.Compensate for how
// to undo a step should the request fail for good (FailSteps).
func Steps(ctx context.Context) *inbox.Steps { return inbox.StepsFrom(ctx) }

// FailSteps fails a steps route's request for good, with cause: once the
// handler returns, the compensations it declared for its completed steps
// run (Steps.Compensate), in reverse order, the key is recorded failed,
// and the handler's response is sent. A retry with the key is answered
// 422 key-failed and runs nothing. It does nothing outside a steps route.
func FailSteps(ctx context.Context, cause error) {
	if f, ok := ctx.Value(failKey{}).(*stepsFailure); ok && cause != nil && f.err == nil {
		f.err = cause
	}
}

type failKey struct{}

// stepsFailure is the slot FailSteps fills.
type stepsFailure struct{ err error }

// serveSteps runs the handler in steps (inbox.Ledger.DoSteps).
func (h *handler) serveSteps(ctx context.Context, w http.ResponseWriter, r *http.Request, req inbox.Request, body []byte) {
	s := h.s
	claimed := time.Now()
	var resp buffered
	var pv *panicked
	ran := false
	run := func(ctx context.Context, st *inbox.Steps) (inbox.Result, error) {
		ran = true
		fail := &stepsFailure{}
		ctx = context.WithValue(bridgereq.WithFencingToken(ctx, st.Token()), failKey{}, fail)
		resp, pv = h.run(withBody(r.WithContext(ctx), body))
		switch {
		case pv != nil:
			return inbox.Result{}, errPanicked // the steps recorded stay
		case fail.err != nil:
			return inbox.Result{}, inbox.Permanent(fail.err)
		case resp.size > int64(len(resp.body)):
			// The steps' effects happened and the response cannot be
			// stored: fail for good, compensating.
			return inbox.Result{}, inbox.Permanent(fmt.Errorf("%w: %d bytes over %d", errTooLarge, resp.size, h.rt.MaxResponseBytes))
		case !h.rt.Store(resp.code):
			return inbox.Result{}, errNotStored // the steps recorded stay
		}
		return s.result(req.Key, resp)
	}
	out, err := s.Ledger.DoSteps(ctx, req, h.rt.LeaseDuration, run)
	if err == nil && !ran && bridgereq.PlainRetry(out, &req) {
		out, err = s.Ledger.DoSteps(ctx, req, h.rt.LeaseDuration, run)
	}
	switch {
	case pv != nil:
		h.repanic(req, pv)
	case errors.Is(err, errNotStored):
		s.log.DebugContext(ctx, "justonce/httpbridge: status not stored; the steps recorded stay for a retry", "key", req.Key.String(), "status", resp.code)
		writeResponse(w, resp.code, resp.header, resp.body)
	case errors.Is(err, errTooLarge):
		h.tooLarge(w, req, resp, "the operation failed for good under this key: its compensations ran")
	case errors.Is(err, inbox.ErrPermanent) && ran && resp.code != 0:
		s.log.InfoContext(ctx, "justonce/httpbridge: steps failed for good; compensated, key failed", "key", req.Key.String(), "err", err)
		writeResponse(w, resp.code, resp.header, resp.body)
	case errors.Is(err, inbox.ErrLeaseLost):
		s.log.ErrorContext(ctx, "justonce/httpbridge: lease lost while the handler ran", "key", req.Key.String(), "err", err)
		writeProblem(w, ProblemLeaseLost, http.StatusInternalServerError,
			"the handler outlived its lease; another attempt may have taken the key over")
	case err != nil:
		s.storeFailure(w, req, err)
	case out.Disposition == inbox.Executed:
		h.setExpires(w, claimed.Add(h.rt.ttl))
		writeResponse(w, resp.code, resp.header, resp.body)
	default:
		h.answer(w, r, req, out)
	}
}
