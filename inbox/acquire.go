package inbox

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5/pgxpool"
)

// acquire takes a connection from the ledger's pool for req, waiting at
// most req.AcquireWait when it is positive. A wait that runs out (with
// ctx still live) is an *OverloadError: no connection came free, nor
// could a new one be opened, in time. Other failures are *StoreError.
func (l *Ledger) acquire(ctx context.Context, req Request) (*pgxpool.Conn, error) {
	wait := req.AcquireWait
	if wait <= 0 {
		pc, err := l.pool.Acquire(ctx)
		if err != nil {
			return nil, storeErr("acquire", err)
		}
		return pc, nil
	}
	actx, cancel := context.WithTimeout(ctx, wait)
	pc, err := l.pool.Acquire(actx)
	cancel()
	if err == nil {
		return pc, nil
	}
	if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		l.stats.overloaded.Add(1)
		return nil, &OverloadError{Wait: wait, Conns: l.pool.Stat().MaxConns()}
	}
	return nil, storeErr("acquire", err)
}

// leaseQuerier is what a lease's claim runs on: the pool itself without
// an AcquireWait (each statement takes a connection as it goes), else a
// connection taken within the wait; release gives it back.
func (l *Ledger) leaseQuerier(ctx context.Context, req Request) (q querier, release func(error), err error) {
	if req.AcquireWait <= 0 {
		return l.pool, func(error) {}, nil
	}
	pc, err := l.acquire(ctx, req)
	if err != nil {
		return nil, nil, err
	}
	return pc, func(err error) { releaseConn(pc, err) }, nil
}
