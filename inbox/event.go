package inbox

import (
	"context"
	"sync/atomic"
)

// The event a handler runs for travels in its context, so that code called
// from the handler (the outbox, a user's own writes) can derive IDs that
// are the same on every run of that handler.

type eventCtxKey struct{}

type eventRun struct {
	key Key
	seq atomic.Int64
}

// WithEvent returns a context that says a handler for key k is running in
// it, with a fresh Sequence. The ledger sets it for the handlers it runs
// (Do, DoTx, DoLeased); a front that runs several events' handlers in one
// transaction (DoBatch) sets it for each event's handler itself.
func WithEvent(ctx context.Context, k Key) context.Context {
	return context.WithValue(ctx, eventCtxKey{}, &eventRun{key: k})
}

// EventKey returns the key of the event whose handler runs with ctx, and
// whether there is one.
func EventKey(ctx context.Context) (Key, bool) {
	if r, ok := ctx.Value(eventCtxKey{}).(*eventRun); ok {
		return r.key, true
	}
	return Key{}, false
}

// Sequence returns 0, 1, 2, ... on successive calls within one run of an
// event's handler (-1 outside one). Every run starts again from 0, so a
// handler that is retried or replayed and makes its calls in the same
// order sees the same numbers: with EventKey they name the handler's
// outputs deterministically (the outbox derives message IDs this way).
func Sequence(ctx context.Context) int64 {
	if r, ok := ctx.Value(eventCtxKey{}).(*eventRun); ok {
		return r.seq.Add(1) - 1
	}
	return -1
}
