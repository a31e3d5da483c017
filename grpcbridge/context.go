package grpcbridge

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/internal/bridgereq"
)

// Tx returns the transaction a covered method's handler runs in: the
// ledger's transaction for a keyed call (its writes, the ledger row and
// the stored answer commit together, before the client gets the answer),
// or a plain transaction for a call without a key on an optional method.
// The handler must not commit or roll it back (Commit and Rollback return
// inbox.ErrTxOwned); the status code it answers decides (MethodConfig.Store).
// Begin opens a savepoint. Tx returns nil outside a covered call.
func Tx(ctx context.Context) pgx.Tx { return bridgereq.Tx(ctx) }

// Key returns the call's idempotency key as parsed (lower-cased for
// KeyUUID), and false for a call without one. Pass it on to downstream
// calls that take an idempotency key of their own.
func Key(ctx context.Context) (string, bool) { return bridgereq.Key(ctx) }
