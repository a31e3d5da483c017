package bridgereq

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// The context a bridge hands a handler: both bridges' Tx and Key (and the
// HTTP bridge's FencingToken) read these values, so a handler's context has
// one shape whichever front made it.

type ctxKey int

const (
	txKey ctxKey = iota
	keyKey
	tokenKey
)

// WithTx returns ctx carrying the transaction the handler runs in.
func WithTx(ctx context.Context, tx pgx.Tx) context.Context {
	return context.WithValue(ctx, txKey, tx)
}

// Tx returns the transaction ctx carries, or nil.
func Tx(ctx context.Context) pgx.Tx {
	tx, _ := ctx.Value(txKey).(pgx.Tx)
	return tx
}

// WithKey returns ctx carrying the request's key, as the front parsed it.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyKey, key)
}

// Key returns the key ctx carries, and false for none.
func Key(ctx context.Context) (string, bool) {
	k, ok := ctx.Value(keyKey).(string)
	return k, ok
}

// WithFencingToken returns ctx carrying a lease's fencing token.
func WithFencingToken(ctx context.Context, token int64) context.Context {
	return context.WithValue(ctx, tokenKey, token)
}

// FencingToken returns the fencing token ctx carries, and false for none.
func FencingToken(ctx context.Context) (int64, bool) {
	t, ok := ctx.Value(tokenKey).(int64)
	return t, ok
}
