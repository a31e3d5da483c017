package httpbridge

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// Tx returns the transaction a transactional route runs its handler in:
// the ledger's transaction for a keyed request (its writes, the ledger row
// and the stored response commit together), or a plain transaction for a
// request without a key on an optional route. The handler must not commit
// or roll it back (Commit and Rollback return inbox.ErrTxOwned); the
// response's status decides (see RouteConfig.Store). Begin opens a
// savepoint.
//
// Tx returns nil outside a covered request: other methods, lease-mode
// routes, or a context the bridge did not make.
func Tx(ctx context.Context) pgx.Tx { return bridgereq.Tx(ctx) }

// FencingToken returns the lease's fencing token in a lease-mode handler,
// and false elsewhere. Pass it to downstream systems so that they can turn
// away a stale holder whose lease expired. It only grows.
func FencingToken(ctx context.Context) (int64, bool) { return bridgereq.FencingToken(ctx) }

// Key returns the request's Idempotency-Key as parsed (sf-string quotes
// and escapes removed; lower-cased on UUID-only routes), and false for a
// request without one. Pass it on to downstream calls that take an
// idempotency key of their own (a payment provider, another API); reading
// the raw header instead would keep the quotes of the structured-field
// form. On a route that isolates principals, two principals may send the
// same key: where principals share one downstream key space, combine the
// key with the principal before passing it on.
func Key(ctx context.Context) (string, bool) { return bridgereq.Key(ctx) }

// Source is what the ledger records as the source of the requests the
// bridge runs.
const Source inbox.Source = "http"
