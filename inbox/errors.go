package inbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Sentinel errors. Match them with errors.Is; the typed errors below carry
// the details and match the sentinels.
var (
	// ErrInvalidKey: a scope, tenant or event ID was rejected before any SQL
	// ran. The error is a *KeyError.
	ErrInvalidKey = errors.New("justonce/inbox: invalid key")

	// ErrNotFound: no live row for the key (absent or expired).
	ErrNotFound = errors.New("justonce/inbox: key not found")

	// ErrLeaseLost: the lease was taken over by another owner, released, or
	// completed already; the fencing token no longer matches.
	ErrLeaseLost = errors.New("justonce/inbox: lease lost")

	// ErrNotStuck: ReleaseStuck left the key's row: the key is done, or
	// processing under a lease that still runs.
	ErrNotStuck = errors.New("justonce/inbox: key is not stuck")

	// ErrStore: a ledger statement failed: the database was unreachable, or
	// it refused the statement. The error is a *StoreError that unwraps to
	// the driver's error (errors.As a *pgconn.PgError works) and names the
	// step that failed. Nothing was recorded unless the error is also
	// ErrCommitUnknown; either way retrying the same key is safe. Whether a
	// retry can help is IsTransient's question, not ErrStore's: a deferred
	// constraint that fails at COMMIT is an ErrStore and not transient.
	ErrStore = errors.New("justonce/inbox: store error")

	// ErrCommitUnknown: the connection failed while the commit was in flight;
	// the commit may or may not have happened. Retrying with the same key is
	// safe: the ledger answers Duplicate if it did.
	ErrCommitUnknown = errors.New("justonce/inbox: commit outcome unknown")

	// ErrRolledBack: the handler returned success, but its transaction had
	// already failed (a statement error it ignored, such as a swallowed
	// unique violation, leaves a Postgres transaction aborted), so COMMIT
	// was answered by ROLLBACK. Nothing was recorded and the handler's
	// writes did not happen. It is the handler's failure, not the
	// database's: consumers count it as an attempt, the HTTP bridge answers
	// it as the handler's error. Handle a SQL error inside a savepoint
	// (tx.Begin) to go on after it.
	ErrRolledBack = errors.New("justonce/inbox: transaction rolled back at commit")

	// ErrTxOwned: a handler tried to commit or roll back the transaction the
	// ledger gave it. The ledger owns that transaction; return an error to
	// roll back.
	ErrTxOwned = errors.New("justonce/inbox: the ledger owns this transaction")

	// ErrOverloaded: no database connection came free within the
	// request's AcquireWait (every connection of the pool stayed in use,
	// or a new one could not be opened in time), so the call gave up
	// before it claimed the key. Nothing ran and nothing
	// was recorded; retrying the same key later is safe. The error is an
	// *OverloadError. IsTransient reports it.
	ErrOverloaded = errors.New("justonce/inbox: overloaded: no database connection within the acquire wait")

	// ErrConfig: the Config is invalid. The error says which field.
	ErrConfig = errors.New("justonce/inbox: invalid config")

	// ErrPermanent marks a failure that retrying cannot cure (a card
	// declined, a request the far side refuses for good). Mark an error
	// with Permanent. A handler run by DoSteps that returns one has its
	// key's completed steps compensated and the key recorded failed;
	// every other error leaves the key to be retried, resuming after its
	// recorded steps.
	ErrPermanent = errors.New("justonce/inbox: permanent failure")
)

// Permanent marks err as permanent: errors.Is(Permanent(err), ErrPermanent)
// holds, and the error reads and unwraps as err. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

// permanentError is an error marked with Permanent.
type permanentError struct{ err error }

func (e *permanentError) Error() string        { return e.err.Error() }
func (e *permanentError) Unwrap() error        { return e.err }
func (e *permanentError) Is(target error) bool { return target == ErrPermanent }

// KeyError says which part of a key was rejected and why.
type KeyError struct {
	Field  string // "scope", "tenant", "event_id", or "step" (a step's name, DoSteps)
	Reason string
}

func (e *KeyError) Error() string {
	return fmt.Sprintf("justonce/inbox: invalid %s: %s", e.Field, e.Reason)
}

// Is reports whether target is ErrInvalidKey.
func (e *KeyError) Is(target error) bool { return target == ErrInvalidKey }

// StoreError wraps a database failure with the ledger step that hit it.
type StoreError struct {
	// Op is the step: "acquire", "claim", "lookup", "handler" (the
	// connection died while the handler ran), "commit", "complete",
	// "release", ...
	Op  string
	Err error
}

func (e *StoreError) Error() string {
	return "justonce/inbox: " + e.Op + ": " + trimPrefix(e.Err)
}

// Unwrap returns the driver error.
func (e *StoreError) Unwrap() error { return e.Err }

// Is reports whether target is ErrStore.
func (e *StoreError) Is(target error) bool { return target == ErrStore }

func storeErr(op string, err error) error {
	if err == nil {
		return nil
	}
	return &StoreError{Op: op, Err: err}
}

// trimPrefix renders err without a leading "justonce/inbox: ", so that
// wrapped ledger errors do not repeat it.
func trimPrefix(err error) string {
	return strings.TrimPrefix(err.Error(), "justonce/inbox: ")
}

// OverloadError is ErrOverloaded with the wait that ran out and the
// pool's size.
type OverloadError struct {
	// Wait is the request's AcquireWait.
	Wait time.Duration
	// Conns is the pool's maximum size (pgxpool's MaxConns).
	Conns int32
}

func (e *OverloadError) Error() string {
	return fmt.Sprintf("justonce/inbox: overloaded: no database connection (of %d) within %s; nothing ran", e.Conns, e.Wait)
}

// Is reports whether target is ErrOverloaded.
func (e *OverloadError) Is(target error) bool { return target == ErrOverloaded }

// commitUnknownError is the cause of a StoreError whose commit was in
// flight when the connection failed.
type commitUnknownError struct{ err error }

func (e *commitUnknownError) Error() string { return "outcome unknown: " + e.err.Error() }
func (e *commitUnknownError) Unwrap() error { return e.err }
func (e *commitUnknownError) Is(target error) bool {
	return target == ErrCommitUnknown
}

// RolledBackError is ErrRolledBack with the step that found the
// transaction aborted.
type RolledBackError struct {
	// Op is "commit" (COMMIT answered ROLLBACK) or "handler" (the handler
	// returned nil on an aborted transaction, found before COMMIT was sent).
	Op string
}

func (e *RolledBackError) Error() string {
	if e.Op == "commit" {
		return "justonce/inbox: COMMIT was answered by ROLLBACK: a statement in the transaction had failed and the handler returned success anyway; nothing was recorded"
	}
	return "justonce/inbox: the handler returned success on an aborted transaction (a statement in it failed); rolled back, nothing recorded"
}

// Is reports whether target is ErrRolledBack.
func (e *RolledBackError) Is(target error) bool { return target == ErrRolledBack }

// IsTransient reports whether err means the database was unavailable or
// the transaction lost a race it may win next time, rather than a fault of
// the event, the request or the handler. It looks at the cause, not at
// which step failed:
//
//   - transient: ErrCommitUnknown; ErrOverloaded; SQLSTATE class 08 (connection), class
//     53 (insufficient resources: too many connections, disk full, out of
//     memory), class 58 (system error, I/O), 25006 (a read-only
//     transaction: a server that became a standby, as after a failover),
//     55P03 (lock not available), 57P01-57P05 (server shutting down or
//     gone), 40001 (serialization failure), 40P01 (deadlock), also when the
//     handler's own query hit them; a ledger step (a *StoreError) that
//     failed because the connection was refused, lost or closed.
//   - not transient: ErrRolledBack, data and constraint errors (classes 22
//     and 23, also when a deferred constraint fails at COMMIT), 25P02 and
//     every other SQLSTATE, context errors, and any error of the handler's
//     own that is not a Postgres one (a handler's failed HTTP call is the
//     handler's failure).
//
// Consumers retry transient errors without counting the attempt, within
// bounds; the HTTP bridge answers 503. Everything else is the handler's
// failure: counted, and dead-lettered after the last attempt.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrCommitUnknown) || errors.Is(err, ErrOverloaded) {
		return true
	}
	if errors.Is(err, ErrRolledBack) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return transientCode(pgErr.Code)
	}
	var se *StoreError
	if !errors.As(err, &se) {
		return false
	}
	return connectionLost(se.Err)
}

func transientCode(c string) bool {
	switch c {
	case "25006", "55P03", "57P01", "57P02", "57P03", "57P04", "57P05", "40001", "40P01":
		return true
	}
	return strings.HasPrefix(c, "08") || strings.HasPrefix(c, "53") || strings.HasPrefix(c, "58")
}

// connectionLost reports whether err is a connection that could not be
// made, was lost, or was closed (not a statement the server refused).
func connectionLost(err error) bool {
	var netErr net.Error
	var connErr *pgconn.ConnectError
	switch {
	case errors.As(err, &connErr), errors.As(err, &netErr),
		errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF), errors.Is(err, net.ErrClosed):
		return true
	}
	msg := err.Error()
	return strings.Contains(msg, "conn closed") || strings.Contains(msg, "unexpected EOF") ||
		strings.Contains(msg, "connection reset") || strings.Contains(msg, "broken pipe") ||
		strings.Contains(msg, "closed pool") || strings.Contains(msg, "failed to connect")
}
