package inbox

import (
	"time"
)

// Status is a ledger row's state.
type Status string

// Row states.
const (
	// StatusProcessing: claimed in lease mode and not yet completed.
	// Transactional-mode rows are never seen in this state: they become
	// visible at commit, already done.
	StatusProcessing Status = "processing"
	// StatusDone: the effect happened; Result holds what it returned.
	StatusDone Status = "done"
	// StatusFailed: given up after retries (dead-lettered); Error says why.
	StatusFailed Status = "failed"
)

// Source says which path ran an event: each front records its own
// ("kafka", "nats", "http", ...).
type Source string

// Result is what a handler recorded: for HTTP the response's status code,
// headers and body; for consumers whatever the handler chose (often nothing).
// A duplicate gets the stored Result back.
type Result struct {
	Code   int
	Header map[string][]string
	Body   []byte
}

// IsZero reports whether nothing is recorded.
func (r Result) IsZero() bool {
	return r.Code == 0 && len(r.Header) == 0 && len(r.Body) == 0
}

// Record is one ledger row.
type Record struct {
	Key
	Status       Status
	Fingerprint  []byte
	Source       Source
	Principal    string
	LeaseOwner   string
	LeaseUntil   time.Time // zero unless processing in lease mode
	FencingToken int64     // grows with every lease claim or takeover
	Attempts     int
	Result       Result
	// ResultGone reports that the row's result passed its own clock
	// (Request.ResultTTL): Result is empty, the key is still known.
	ResultGone  bool
	Error       string
	Duration    time.Duration // handler run time, when recorded
	CreatedAt   time.Time
	CompletedAt time.Time // zero while processing
	ExpiresAt   time.Time
}

// Disposition says what a Do call did.
type Disposition uint8

// Dispositions.
const (
	// Executed: the handler ran now and its effect committed.
	Executed Disposition = iota + 1
	// Duplicate: the key was done (or failed) already; the handler did not
	// run. Outcome.Record holds the stored row and its Result.
	Duplicate
	// InFlight: another caller holds the key right now; the handler did not
	// run. Retry later.
	InFlight
	// Mismatch: the key is known with another fingerprint (same key,
	// different request); the handler did not run.
	Mismatch
)

var dispositionNames = [...]string{"", "executed", "duplicate", "in_flight", "mismatch"}

func (d Disposition) String() string {
	if int(d) < len(dispositionNames) {
		return dispositionNames[d]
	}
	return "unknown"
}

// Outcome tells the caller what happened.
type Outcome struct {
	Disposition Disposition
	// Result is what the handler returned (Executed) or what was stored
	// (Duplicate).
	Result Result
	// Record is the row: as committed for Executed (from Do), as stored
	// for Duplicate and Mismatch, and for InFlight when a row is visible
	// (lease mode). It may be nil for InFlight.
	Record *Record
	// Cached reports that a Duplicate was answered from the Redis replay
	// cache without asking Postgres.
	Cached bool
}

// Request describes one keyed operation.
type Request struct {
	Key
	// Fingerprint identifies the request's content (HTTP: a hash of method,
	// route, body). A known key with another fingerprint is a Mismatch.
	// Nil disables the check.
	Fingerprint []byte
	// Source is recorded for audit (http, kafka, nats, ...).
	Source Source
	// Principal is recorded for audit (the user or service that asked).
	Principal string
	// TTL overrides the ledger's default retention for this row. After it
	// the key is new again.
	TTL time.Duration
	// ResultTTL overrides Config.ResultTTL for this row: how long its
	// result (Result: a stored response) is kept, from the handler's end.
	// Past it the key still deduplicates, but a duplicate gets the row
	// without its result (Record.ResultGone), and the janitor clears the
	// stored code, headers and body. Zero, or a value not shorter than the
	// row's TTL: the result lives as long as the row.
	ResultTTL time.Duration
	// LockWait is how long to keep trying while another caller holds the
	// key, before answering InFlight. No connection is held while waiting.
	// Zero (the default, and what consumers use: the broker redelivers)
	// answers InFlight at once.
	LockWait time.Duration
	// AcquireWait bounds the wait for a connection from the ledger's pool
	// (Do, AcquireLease, DoLeased, DoSteps): when every connection stays
	// in use that long, the call gives up with an *OverloadError
	// (ErrOverloaded) before it claims the key: nothing runs, nothing is
	// recorded. Zero (the default, and what consumers use: under load
	// their fetches pause) waits as long as ctx allows. The request
	// fronts set it (httpbridge and grpcbridge Config.AcquireWait) so that
	// an overloaded database sheds requests instead of queueing them.
	AcquireWait time.Duration
}
