package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/justonce/justonce/inbox"
)

// Steps returns the *inbox.Steps of the event whose handler runs with ctx,
// when the Processor runs steps (Config.Steps), and nil otherwise. The
// handler records its work with them: Steps.Tx for a Postgres step,
// Steps.Call for an outside one (its key, inbox.StepKey, goes to the
// outside service as its idempotency key), Steps.Compensate for how to
// undo a step should the event fail for good.
func Steps(ctx context.Context) *inbox.Steps { return inbox.StepsFrom(ctx) }

// processSteps makes one attempt at m with Config.Steps: the handler runs
// under inbox.Ledger.DoSteps, alone.
func (p *Processor) processSteps(ctx context.Context, m *Message, req inbox.Request) Decision {
	start := time.Now()
	var out inbox.Outcome
	var err error
	ran := false
	out, err = p.cfg.Ledger.DoSteps(ctx, req, 0, func(ctx context.Context, _ *inbox.Steps) (res inbox.Result, err error) {
		ran = true
		func() {
			defer recovered(&err)
			res, err = p.call(ctx, nil, m)
		}()
		if err != nil && p.deadEnd(ctx, m, err) {
			// This failure dead-letters: make it permanent, so that the
			// ledger runs the declared compensations and records the key
			// failed before the message goes.
			err = inbox.Permanent(err)
		}
		return res, err
	})
	if errors.Is(err, inbox.ErrLeaseLost) && ctx.Err() == nil {
		// Another holder took the key over (this one was held up past its
		// lease) and finishes it: come back, without counting, to find it
		// done.
		return p.transient(ctx, m, err, ran, p.cfg.Backoff.Delay(m.Uncounted+1))
	}
	return p.decide(ctx, m, out, err, time.Since(start), ran)
}

// deadEnd reports whether decide would dead-letter the handler's error err
// (after the handler ran): a counted failure that Retryable refuses, or on
// the last attempt.
func (p *Processor) deadEnd(ctx context.Context, m *Message, err error) bool {
	if ctx.Err() != nil || inbox.IsTransient(err) || errors.Is(err, inbox.ErrLeaseLost) || IsPermanent(err) {
		return false // retried, stopped, or permanent already
	}
	return !p.cfg.Retryable(err) || m.Attempt >= p.cfg.MaxAttempts
}
