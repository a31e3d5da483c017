package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/inbox"
)

// ProcessBatch handles a poll batch: it asks the ledger which IDs are new
// in one statement, runs the handler for each new message in one
// transaction, records them and commits once. It returns one Decision per
// message, in order.
//
// If the batch fails for a reason other than the database being
// unavailable (a handler returned an error or panicked, a handler left the
// transaction aborted so that COMMIT rolled back, a deferred constraint
// failed at COMMIT), nothing of it is recorded and every new message is
// processed again on its own (Process), so that one poison message is
// retried and dead-lettered alone while the others run. When the database
// is unavailable every message is retried, uncounted. Messages without an
// ID are processed on their own too.
func (p *Processor) ProcessBatch(ctx context.Context, msgs []*Message) []Decision {
	ds := make([]Decision, len(msgs))
	if err := ctx.Err(); err != nil {
		for i := range ds {
			ds[i] = Decision{Action: Stop, Err: err}
		}
		return ds
	}
	var keyed []int
	var reqs []inbox.Request
	for i, m := range msgs {
		if m.Attempt < 1 {
			m.Attempt = 1
		}
		if m.ID == "" {
			if id, err := p.cfg.ID(m); err == nil && id != "" {
				m.ID = id
			}
		}
		r := p.request(m)
		if m.ID == "" || p.cfg.Ledger.Validate(r) != nil {
			ds[i] = p.Process(ctx, m)
			continue
		}
		keyed = append(keyed, i)
		reqs = append(reqs, r)
	}
	if len(reqs) == 0 {
		return ds
	}

	start := time.Now()
	var outs []inbox.Outcome
	var err error
	errBatch := errors.New("batch handler failed")
	var handlerErr error
	ran := make([]bool, len(keyed)) // by position in keyed
	func() {
		defer recovered(&handlerErr)
		outs, err = p.cfg.Ledger.DoBatch(ctx, reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
			results := make([]inbox.Result, len(fresh))
			for j, k := range fresh {
				ran[k] = true
				m := msgs[keyed[k]]
				res, err := p.call(inbox.WithEvent(ctx, reqs[k].Key), tx, m)
				if err != nil {
					handlerErr = err
					return nil, errBatch
				}
				results[j] = res
			}
			return results, nil
		})
	}()
	took := time.Since(start)
	if (handlerErr != nil || err != nil) && ctx.Err() != nil {
		cause := err
		if handlerErr != nil {
			cause = handlerErr
		}
		for k, i := range keyed {
			ds[i] = Decision{Action: Stop, Err: stopErr(ctx, cause), HandlerRan: ran[k]}
		}
		return ds
	}
	if handlerErr != nil || (err != nil && !inbox.IsTransient(err)) {
		// A handler failed (or the batch could not commit for a reason
		// of the handlers'): isolate the failure, each message on its own.
		for _, i := range keyed {
			ds[i] = p.Process(ctx, msgs[i])
		}
		return ds
	}
	if err != nil {
		// The database is unavailable (or a race was lost): one failure
		// of the batch, every message retried without counting.
		delay := p.transientDelay(0, err)
		for k, i := range keyed {
			ds[i] = p.transient(ctx, msgs[i], err, ran[k], delay)
		}
		return ds
	}
	per := took / time.Duration(len(keyed))
	for k, i := range keyed {
		ds[i] = p.decide(ctx, msgs[i], outs[k], nil, per, ran[k])
	}
	return ds
}
