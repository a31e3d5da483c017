package consumer

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/inbox"
)

// RunLimits bound a ProcessRun.
type RunLimits struct {
	// MaxTime: once the run has been going this long, no further message
	// starts; what ran commits. Zero: no bound.
	MaxTime time.Duration
	// Stop, once closed, ends the run the same way (a front closes it when
	// it stops: the messages not started are left to it). Nil: never.
	Stop <-chan struct{}
}

// ProcessRun makes one attempt at the head of msgs, messages that must be
// decided in order (one partition's, one subject's), and returns the
// Decisions of msgs[:len(ds)], in order; there is at least one when msgs
// is not empty. It is how the fronts batch: they pass what is waiting and
// settle what it decided before calling it again with the rest.
//
// Several messages run in one transaction (inbox.Ledger.DoEach: their keys
// claimed together, each handler as if in a savepoint of its own), and
// commit together. A message whose handler fails (an error, a panic, nil returned on a
// failed statement) is rolled back alone: the messages before it commit,
// and the run ends with its Decision (a counted Retry, or a dead letter),
// so that the caller retries it in place (Retry) before the messages
// behind it run, as in Process. The handlers of the messages before it
// may have been called twice then: DoEach runs them without a savepoint
// each first, and runs them again on savepoints when a later handler
// fails; their writes through tx commit once, what they do outside it
// happens again. The run also ends at a message held
// InFlight elsewhere, and starts no message beyond its RunLimits.
// When the transaction fails as a whole for a reason of the handlers' (a
// deferred constraint failing at COMMIT, a handler that ended the
// transaction), the messages that ran are processed again one by one
// (Process), up to the first that is not acked; when the database is
// unavailable they are retried uncounted. A single message, and a message
// without an ID at the head, go through Process: batching adds no cost
// when nothing else is waiting. With Config.Steps every run is one message
// (Process): steps handlers never share a transaction.
func (p *Processor) ProcessRun(ctx context.Context, msgs []*Message, lim RunLimits) []Decision {
	if len(msgs) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return []Decision{{Action: Stop, Err: err}}
	}
	if p.cfg.Observe {
		// Observe mode runs each message on its own (a run of one).
		return []Decision{p.Process(ctx, msgs[0])}
	}
	if p.cfg.Steps {
		return []Decision{p.Process(ctx, msgs[0])} // each event under its own lease
	}
	reqs := make([]inbox.Request, 0, len(msgs))
	for _, m := range msgs {
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
			break // decided on its own, in order, by a later call
		}
		reqs = append(reqs, r)
	}
	if len(reqs) <= 1 {
		return []Decision{p.Process(ctx, msgs[0])}
	}

	start := time.Now()
	ran := make([]bool, len(reqs))
	run, err := p.cfg.Ledger.DoEach(ctx, reqs, inbox.EachOptions{MaxTime: lim.MaxTime, Stop: lim.Stop},
		func(ctx context.Context, tx pgx.Tx, i int) (res inbox.Result, err error) {
			ran[i] = true
			defer recovered(&err)
			return p.call(ctx, tx, msgs[i])
		})
	took := time.Since(start)
	nran := 0
	for i, r := range ran {
		if r {
			nran = i + 1
		}
	}
	if err != nil {
		n := max(nran, 1)
		ds := make([]Decision, 0, n)
		switch {
		case ctx.Err() != nil:
			for i := 0; i < n; i++ {
				ds = append(ds, Decision{Action: Stop, Err: stopErr(ctx, err), HandlerRan: ran[i]})
			}
		case !inbox.IsTransient(err):
			// The transaction failed for a reason of the handlers': run
			// each alone, up to the first that is not done.
			for i := 0; i < n; i++ {
				d := p.Process(ctx, msgs[i])
				ds = append(ds, d)
				if d.Action != Ack {
					break
				}
			}
		default:
			// The database is unavailable (or a race was lost): one
			// failure for the run, every message that ran retried
			// without counting.
			delay := p.transientDelay(0, err)
			for i := 0; i < n; i++ {
				ds = append(ds, p.transient(ctx, msgs[i], err, ran[i], delay))
			}
		}
		return ds
	}
	ds := make([]Decision, len(run.Outcomes))
	per := took / time.Duration(len(run.Outcomes))
	for i, out := range run.Outcomes {
		if run.Failed != nil && i == len(run.Outcomes)-1 {
			ds[i] = p.decide(ctx, msgs[i], inbox.Outcome{}, run.Failed, per, ran[i])
			continue
		}
		d := per
		if out.Record != nil && out.Record.Duration > 0 && out.Disposition == inbox.Executed {
			d = out.Record.Duration
		}
		ds[i] = p.decide(ctx, msgs[i], out, nil, d, ran[i])
	}
	return ds
}

// inboxUnavailable reports whether err says the database could not be
// reached (a transient store error that is not a lost race).
func inboxUnavailable(err error) bool {
	return err != nil && inbox.IsTransient(err) && !lostRace(err) && !errors.Is(err, errInFlight)
}
