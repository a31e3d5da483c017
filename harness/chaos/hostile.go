package main

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/consumer"
)

// hostileKind is what a hostile handler does to its transaction.
type hostileKind int

const (
	normal         hostileKind = iota
	swallowOnce                // swallows a unique violation on its first attempts, then behaves
	swallowAlways              // always swallows a unique violation: must be dead-lettered
	deferredOnce               // a deferred constraint fails at COMMIT on its first attempts
	deferredAlways             // a deferred constraint always fails at COMMIT
	panicOnce                  // panics on its first attempts
	panicAlways                // always panics
	slow                       // slower than the Redis lock TTL, then succeeds
	numKinds
)

var kindNames = [...]string{"normal", "swallow-once", "swallow-always", "deferred-once", "deferred-always",
	"panic-once", "panic-always", "slow"}

func (k hostileKind) String() string { return kindNames[k] }

// permanent reports whether events of this kind fail on every attempt
// (until an operator repairs and releases them).
func (k hostileKind) permanent() bool {
	return k == swallowAlways || k == deferredAlways || k == panicAlways
}

// failingAttempts is how many first attempts of an intermittent kind fail.
// It stays below maxAttempts so that they must end with their effect.
const (
	failingAttempts = 2
	maxAttempts     = 4
)

// kindOf classifies an event ID ("k-123", "n-123") from its number: every
// every-th event is hostile, the kinds in turn. The worker and the
// verdict agree on it without talking.
func kindOf(id string, every int) hostileKind {
	if every <= 0 {
		return normal
	}
	i := strings.LastIndexByte(id, '-')
	n, err := strconv.Atoi(id[i+1:])
	if err != nil || n%every != every-1 {
		return normal
	}
	return 1 + hostileKind((n/every)%int(numKinds-1))
}

// hostileHandler is the business handler: one effect row per run (no
// unique constraint, so a doubled effect shows), and for hostile events
// the misbehaviour of their kind. report is told each misbehaviour.
func hostileHandler(transport string, every int, slowFor time.Duration, report func(string)) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if _, err := tx.Exec(ctx, `INSERT INTO effects (event_id, transport) VALUES ($1, $2)`, m.ID, transport); err != nil {
			return err
		}
		return misbehave(ctx, tx, m, kindOf(m.ID, every), slowFor, report)
	}
}

// misbehave does what a hostile handler of kind k does to tx (nothing for
// normal events).
func misbehave(ctx context.Context, tx pgx.Tx, m *consumer.Message, k hostileKind, slowFor time.Duration, report func(string)) error {
	if k == normal {
		return nil
	}
	fail := m.Attempt <= failingAttempts
	if k.permanent() {
		// An operator may have repaired the handler for this event and
		// released its key (see operatorRelease).
		var repaired bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM repaired WHERE event_id = $1)`, m.ID).Scan(&repaired); err != nil {
			return err
		}
		fail = !repaired
	}
	switch k {
	case slow:
		report("slow")
		t := time.NewTimer(slowFor)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
		return nil
	case swallowOnce, swallowAlways:
		if fail {
			report("swallow")
			// "Ignore the unique violation and go on": the transaction is
			// aborted now, and the handler says all is well.
			_, _ = tx.Exec(ctx, `INSERT INTO taken (k) VALUES ('taken')`)
		}
		return nil
	case deferredOnce, deferredAlways:
		if fail {
			report("deferred")
			// Checked at COMMIT only.
			if _, err := tx.Exec(ctx, `INSERT INTO deferred_child (id, parent) VALUES ($1, 'missing')`, m.ID); err != nil {
				return err
			}
		}
		return nil
	case panicOnce, panicAlways:
		if fail {
			report("panic")
			panic("chaos: hostile handler panics on " + m.ID)
		}
		return nil
	}
	return nil
}

// hostileSchema creates what the hostile handlers need.
const hostileSchema = `
CREATE TABLE effects (event_id text NOT NULL, transport text NOT NULL, msg_id text, n bigserial);
CREATE TABLE taken (k text PRIMARY KEY);
INSERT INTO taken VALUES ('taken');
CREATE TABLE deferred_parent (id text PRIMARY KEY);
CREATE TABLE deferred_child (id text, parent text REFERENCES deferred_parent (id) DEFERRABLE INITIALLY DEFERRED);
CREATE TABLE repaired (event_id text PRIMARY KEY);
`
