package bridgereq

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/justonce/justonce/inbox"
)

// Begin begins the transaction of a keyless request on pool, waiting at
// most wait for a connection (no bound when wait <= 0): when the wait runs
// out, the request is shed with an
// *inbox.OverloadError, as the ledger sheds a keyed one. Ending the
// transaction (Commit or Rollback) gives the connection back.
func Begin(ctx context.Context, pool *pgxpool.Pool, wait time.Duration) (pgx.Tx, error) {
	if wait <= 0 {
		return pool.Begin(ctx)
	}
	actx, cancel := context.WithTimeout(ctx, wait)
	pc, err := pool.Acquire(actx)
	cancel()
	if err != nil {
		if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
			return nil, &inbox.OverloadError{Wait: wait, Conns: pool.Stat().MaxConns()}
		}
		return nil, err
	}
	tx, err := pc.Begin(ctx)
	if err != nil {
		pc.Release()
		return nil, err
	}
	return &connTx{Tx: tx, release: sync.OnceFunc(pc.Release)}, nil
}

// connTx is a transaction on a connection taken from the pool, which it
// gives back when it ends.
type connTx struct {
	pgx.Tx
	release func()
}

func (t *connTx) Commit(ctx context.Context) error {
	err := t.Tx.Commit(ctx)
	t.release()
	return err
}

func (t *connTx) Rollback(ctx context.Context) error {
	err := t.Tx.Rollback(ctx)
	t.release()
	return err
}
