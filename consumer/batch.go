package consumer

import (
	"context"
)

// ProcessBatch makes one attempt at each of msgs and returns one Decision
// per message, in order. Messages run in shared transactions, each
// message as if in a savepoint of its own (see ProcessRun): a
// message whose handler fails (returns an error, panics, or returns nil on
// a failed statement) is rolled back alone, its Decision is a counted
// Retry (or a dead letter), and the others commit. When a transaction
// fails as a whole for a reason of the handlers' (a deferred constraint
// failing at COMMIT), its messages are processed again one by one
// (Process), so that the poison message is retried and dead-lettered
// alone. When the database is unavailable every message is retried,
// uncounted. Messages without an ID are processed on their own.
//
// The Decisions are made for the whole batch before any is carried on, so
// a retried message runs after the messages behind it: use ProcessRun
// where order matters.
func (p *Processor) ProcessBatch(ctx context.Context, msgs []*Message) []Decision {
	ds := make([]Decision, len(msgs))
	if err := ctx.Err(); err != nil {
		for i := range ds {
			ds[i] = Decision{Action: Stop, Err: err}
		}
		return ds
	}
	for i := 0; i < len(msgs); {
		part := p.ProcessRun(ctx, msgs[i:], RunLimits{})
		copy(ds[i:], part)
		i += len(part)
		last := part[len(part)-1]
		if last.Action == Retry && !last.Counted && !last.HandlerRan && inboxUnavailable(last.Err) {
			// The database does not answer: the rest fails the same way,
			// without another try.
			for ; i < len(msgs); i++ {
				if msgs[i].Attempt < 1 {
					msgs[i].Attempt = 1
				}
				ds[i] = p.retry(msgs[i], Decision{Delay: last.Delay, Err: last.Err})
			}
		}
	}
	return ds
}
