package inbox

import (
	"context"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// The event a handler runs for travels in its context, so that code called
// from the handler (the outbox, a user's own writes) can derive IDs that
// are the same on every run of that handler.

type eventCtxKey struct{}

type eventRun struct {
	key Key
	seq atomic.Int64

	// Set by Do for its handler: statements queued with AtCommit on tx
	// travel with the ledger's commit.
	deferring bool
	mu        sync.Mutex
	tx        pgx.Tx
	queued    []queuedStmt
}

// queuedStmt is a statement to queue on a later batch.
type queuedStmt struct {
	sql  string
	args []any
}

func (q queuedStmt) queue(b *pgx.Batch) { b.Queue(q.sql, q.args...) }

// withEventAtCommit is WithEvent for a handler whose ledger sends the
// statements queued with AtCommit in its commit's round trip.
func withEventAtCommit(ctx context.Context, k Key) (context.Context, *eventRun) {
	r := &eventRun{key: k, deferring: true}
	return context.WithValue(ctx, eventCtxKey{}, r), r
}

// runOf returns the run ctx carries, or nil.
func runOf(ctx context.Context) *eventRun {
	r, _ := ctx.Value(eventCtxKey{}).(*eventRun)
	return r
}

// flush queues the statements AtCommit collected into b.
func (r *eventRun) flush(b *pgx.Batch) {
	if r == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, q := range r.queued {
		q.queue(b)
	}
	r.queued = nil
}

// AtCommit queues a write (an insert whose result the handler does not
// need) to run in tx just before the ledger commits it, in the commit's
// round trip, and reports whether it did. It does so only inside a
// handler that Ledger.Do runs, and only for the transaction Do gave that
// handler (not a savepoint opened from it, whose rollback the queued
// statement would outlive); elsewhere it returns false and the caller runs
// the statement itself. A queued statement that fails makes the commit
// fail: nothing of the handler is recorded, and the event runs again. The
// outbox queues its insert this way.
func AtCommit(ctx context.Context, tx pgx.Tx, sql string, args ...any) bool {
	r := runOf(ctx)
	if r == nil || !r.deferring {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.tx == nil || r.tx != tx {
		return false
	}
	r.queued = append(r.queued, queuedStmt{sql, args})
	return true
}

// WithEvent returns a context that says a handler for key k is running in
// it, with a fresh Sequence. The ledger sets it for the handlers it runs
// (Do, DoTx, DoLeased, DoSteps; inside a step of DoSteps it is the step's
// own key, see Steps.Tx); a front that runs several events' handlers in one
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
