package inbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrNotReplicated: the ledger's database acknowledges a commit before any
// standby has it, so a failover to a standby can lose commits the ledger
// reported Executed (their effects included) and run those events again.
// CheckReplication returns it, wrapped with the reason.
var ErrNotReplicated = errors.New("justonce/inbox: commits are acknowledged before a standby has them")

// Replication is what the ledger's database says about how its commits
// reach standbys, as the ledger's own connections see it.
type Replication struct {
	// SynchronousCommit is synchronous_commit on the ledger's connections:
	// "on", "remote_apply" or "remote_write" wait for the synchronous
	// standbys (if any are named), "local" and "off" never do.
	SynchronousCommit string
	// SynchronousStandbyNames is the server's synchronous_standby_names;
	// empty: no standby is waited for (asynchronous replication).
	SynchronousStandbyNames string
	// Standbys is how many standbys stream from the server
	// (pg_stat_replication; a standby of a standby is not counted).
	Standbys int
	// SyncStandbys is how many of them the server waits for at each
	// commit now (sync_state sync or quorum). 0 with
	// SynchronousStandbyNames set means commits wait until one connects.
	// -1 when the ledger's role may not read it (grant it
	// pg_read_all_stats).
	SyncStandbys int
	// InRecovery: the server is itself a standby (the ledger cannot write
	// there).
	InRecovery bool
}

// Durable reports whether every commit the server acknowledges to the
// ledger is already on a synchronous standby (flushed with "on", applied
// with "remote_apply", written to the standby's operating system with
// "remote_write"), so that promoting that standby loses none of them.
func (r Replication) Durable() bool {
	switch r.SynchronousCommit {
	case "on", "remote_apply", "remote_write":
		return r.SynchronousStandbyNames != "" && !r.InRecovery
	}
	return false
}

// reason says why the server's commits are not durable across a failover,
// or "" when they are.
func (r Replication) reason() string {
	switch {
	case r.Durable():
		return ""
	case r.InRecovery:
		return "the server is a standby"
	case r.SynchronousCommit != "on" && r.SynchronousCommit != "remote_apply" && r.SynchronousCommit != "remote_write":
		return fmt.Sprintf("synchronous_commit is %q: the server acknowledges a commit before any standby has it", r.SynchronousCommit)
	case r.Standbys > 0:
		return fmt.Sprintf("synchronous_standby_names is empty: the %d standby(s) streaming from the server receive each commit after it was acknowledged (asynchronous replication)", r.Standbys)
	default:
		return "no standby streams from the server and none is waited for"
	}
}

// CheckReplication asks the ledger's database whether the commits it
// acknowledges are on a standby already, for a start-up check or a
// readiness probe where the database has a standby that a failover
// promotes. It returns what the server says, and an error matching
// ErrNotReplicated (with the reason) when a failover could lose commits
// the ledger reported done: synchronous_commit is local or off, or
// synchronous_standby_names is empty (asynchronous standbys, or none), or
// the server is a standby. A query that fails is a *StoreError.
//
// The answer is the server's now: a failover manager that empties
// synchronous_standby_names while no standby is connected (Patroni's
// default, non-strict mode) makes it ErrNotReplicated for that time.
func (l *Ledger) CheckReplication(ctx context.Context) (Replication, error) {
	r, err := l.store.rows.replication(ctx, l.pool)
	if err != nil {
		return Replication{}, storeErr("replication", err)
	}
	if why := r.reason(); why != "" {
		return r, fmt.Errorf("%w: %s", ErrNotReplicated, why)
	}
	return r, nil
}

// releaseConn returns pc to the pool, or closes it first when a statement
// on it was refused as a write on a read-only server (SQLSTATE 25006): the
// server it reaches is a standby or a primary fenced read-only (after a
// failover, or a switchover), and every later write there would be refused
// too. Closed, it is dropped by the pool, whose next connection finds the
// primary again (with a multi-host connection string and
// target_session_attrs=read-write, or an address that moved to the new
// primary).
func releaseConn(pc *pgxpool.Conn, errs ...error) {
	for _, err := range errs {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "25006" {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			_ = pc.Conn().Close(ctx)
			cancel()
			break
		}
	}
	pc.Release()
}
