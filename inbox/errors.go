package inbox

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

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

	// ErrStore: the database failed or could not be reached. The error is a
	// *StoreError that unwraps to the driver's error (errors.As a
	// *pgconn.PgError works). Nothing was recorded unless the error is
	// ErrCommitUnknown; either way retrying the same key is safe.
	ErrStore = errors.New("justonce/inbox: store error")

	// ErrCommitUnknown: the connection failed while the commit was in flight;
	// the commit may or may not have happened. Retrying with the same key is
	// safe: the ledger answers Duplicate if it did.
	ErrCommitUnknown = errors.New("justonce/inbox: commit outcome unknown")

	// ErrTxOwned: a handler tried to commit or roll back the transaction the
	// ledger gave it. The ledger owns that transaction; return an error to
	// roll back.
	ErrTxOwned = errors.New("justonce/inbox: the ledger owns this transaction")

	// ErrConfig: the Config is invalid. The error says which field.
	ErrConfig = errors.New("justonce/inbox: invalid config")
)

// KeyError says which part of a key was rejected and why.
type KeyError struct {
	Field  string // "scope", "tenant" or "event_id"
	Reason string
}

func (e *KeyError) Error() string {
	return fmt.Sprintf("justonce/inbox: invalid %s: %s", e.Field, e.Reason)
}

// Is reports whether target is ErrInvalidKey.
func (e *KeyError) Is(target error) bool { return target == ErrInvalidKey }

// StoreError wraps a database failure with the ledger operation that hit it.
type StoreError struct {
	Op  string // "claim", "commit", "lookup", ...
	Err error
}

func (e *StoreError) Error() string {
	return fmt.Sprintf("justonce/inbox: %s: %v", e.Op, e.Err)
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

// IsTransient reports whether err means the database was unavailable or
// the transaction lost a race it may win next time, rather than a fault of
// the event or request: any ErrStore, a lost or refused connection, a
// server shutting down (SQLSTATE class 08, 57P01-57P03), a serialization
// failure (40001) or a deadlock (40P01), also when the handler's own query
// hit it. Consumers retry such errors without counting the attempt; the
// HTTP bridge answers 503.
func IsTransient(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, ErrStore) || errors.Is(err, ErrCommitUnknown) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		c := pgErr.Code
		return strings.HasPrefix(c, "08") || c == "57P01" || c == "57P02" || c == "57P03" || c == "40001" || c == "40P01"
	}
	var netErr net.Error
	if errors.As(err, &netErr) || pgconn.Timeout(err) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return true
	}
	var connErr *pgconn.ConnectError
	if errors.As(err, &connErr) {
		return true
	}
	return strings.Contains(err.Error(), "conn closed") || strings.Contains(err.Error(), "unexpected EOF")
}
