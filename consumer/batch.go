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
// If any handler in the batch fails, the batch's transaction rolls back and
// every new message is processed again on its own (Process), so that one
// poison message is retried and dead-lettered alone while the others run.
// Messages without an ID are processed on their own too.
func (p *Processor) ProcessBatch(ctx context.Context, msgs []*Message) []Decision {
	ds := make([]Decision, len(msgs))
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
	func() {
		defer recovered(&handlerErr)
		outs, err = p.cfg.Ledger.DoBatch(ctx, reqs, func(ctx context.Context, tx pgx.Tx, fresh []int) ([]inbox.Result, error) {
			results := make([]inbox.Result, len(fresh))
			for j, k := range fresh {
				m := msgs[keyed[k]]
				res, err := p.call(ctx, tx, m)
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
	if handlerErr != nil || errors.Is(err, errBatch) {
		// Isolate the failure: each message on its own.
		for _, i := range keyed {
			ds[i] = p.Process(ctx, msgs[i])
		}
		return ds
	}
	if err != nil {
		for _, i := range keyed {
			ds[i] = p.decide(ctx, msgs[i], reqs[0], inbox.Outcome{}, err, took)
		}
		return ds
	}
	per := took / time.Duration(len(keyed))
	for k, i := range keyed {
		ds[i] = p.decide(ctx, msgs[i], reqs[k], outs[k], nil, per)
	}
	return ds
}
