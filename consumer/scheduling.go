package consumer

import (
	"fmt"
	"time"

	"github.com/justonce/justonce/inbox"
)

// Ordering says which messages must run one after the other when
// Scheduling.Concurrency is above 1.
type Ordering uint8

// Orderings.
const (
	// ByPartition (the default) runs each partition's messages in offset
	// order; different partitions may run at the same time. On a broker
	// without partitions the front says what it keeps (natsinbox: the
	// stream's order with Concurrency 1).
	ByPartition Ordering = iota
	// ByKey runs the messages of one key (within a partition) in offset
	// order; different keys of one partition may run at the same time.
	// Messages without a key are ordered by partition. Only fronts whose
	// messages have keys accept it (the Kafka fronts).
	ByKey
)

// String returns the ordering's name.
func (o Ordering) String() string {
	switch o {
	case ByPartition:
		return "ByPartition"
	case ByKey:
		return "ByKey"
	}
	return fmt.Sprintf("Ordering(%d)", uint8(o))
}

// Defaults of Scheduling, which every consumer front applies to the zero
// fields of its Config's Scheduling unless its documentation says that it
// has a default of its own (natsinbox: Concurrency, MaxBuffered).
const (
	// DefaultConcurrency is Scheduling.Concurrency's default: four
	// messages (or batches) run at once, each in its own transaction on a
	// connection of its own.
	DefaultConcurrency = 4
	// DefaultMaxBuffered is Scheduling.MaxBuffered's default.
	DefaultMaxBuffered = 1000
	// DefaultBatchSize is Scheduling.BatchSize's default: up to 50
	// waiting messages run in one transaction. It keeps the savepoints of
	// a batch that runs on savepoints (one per message: after a handler
	// failed, or on the time-bucket layout) within the 64 subtransactions
	// Postgres tracks per transaction without overflowing to disk.
	DefaultBatchSize = 50
	// DefaultBatchMaxTime is Scheduling.BatchMaxTime's default.
	DefaultBatchMaxTime = 50 * time.Millisecond
	// DefaultShutdownTimeout is Scheduling.ShutdownTimeout's default.
	DefaultShutdownTimeout = 30 * time.Second
)

// Scheduling says how a consumer front runs the messages it has fetched:
// how many run at once, which stay in order, how many may wait, how they
// share transactions, and how long a shutdown waits for them. Every
// consumer front's Config embeds it, so the fields have the same names
// and meaning everywhere:
//
//	kafkainbox.Config{
//		Brokers: brokers, Topic: "orders", GroupID: "billing",
//		Processor:  consumer.Config{Ledger: ledger},
//		Scheduling: consumer.Scheduling{Concurrency: 8, Ordering: consumer.ByKey},
//	}
//
// The zero value of every field is its default (the Default constants,
// unless the front documents its own). Negative values are refused.
//
// Messages wait in lanes: each lane holds the messages that must run one
// after the other (a partition's, or a key's with ByKey) and runs them in
// order. A message waiting to be retried holds up its own lane only, and
// gives its Concurrency slot back while it waits, so the other lanes go
// on.
type Scheduling struct {
	// Concurrency is how many messages (or batches) may run at once.
	// Default DefaultConcurrency (4), each needing a database connection of
	// its own while it runs: size the pool for it. Messages of one lane
	// run in order whatever the value (see Ordering). A message waiting to
	// be retried holds up only the messages behind it in its lane, for up
	// to Processor.MaxAttempts backoffs; it does not hold a Concurrency
	// slot while it waits, so the other lanes go on.
	Concurrency int
	// Ordering when Concurrency > 1. Default ByPartition.
	Ordering Ordering
	// MaxBuffered is how many fetched messages may wait to run, across
	// lanes. Messages behind a message waiting to be retried wait here
	// while the other lanes go on; when MaxBuffered are waiting, fetching
	// pauses until the retried message is done, acked or dead-lettered.
	// Default DefaultMaxBuffered (1000).
	MaxBuffered int

	// BatchSize is how many messages of one lane may run in one
	// transaction. When several fetched messages of a lane are waiting, up
	// to BatchSize of them run in one transaction, each message as if in a
	// savepoint of its own (Processor.ProcessRun), and commit together; a
	// message whose handler fails is rolled back alone, the
	// ones before it commit, and it is retried in place (or
	// dead-lettered) before the ones behind it run, as in per-message
	// mode; the handlers before it may be called twice (see
	// Processor.ProcessRun). A message that is alone in its lane runs at once in a
	// transaction of its own: batches form under load only, and add no
	// latency when the consumer keeps up. Default DefaultBatchSize (50);
	// 1 turns batching off (one message, one transaction).
	BatchSize int
	// BatchMaxTime bounds a batch in time: once its transaction has been
	// running this long it starts no further message and commits what
	// ran (the rest runs in the next batch). Default DefaultBatchMaxTime
	// (50 ms).
	BatchMaxTime time.Duration
	// BatchLinger is how long a batch waits for more messages once it has
	// its first one. Default 0: a batch is what has already been fetched,
	// and never waits.
	BatchLinger time.Duration

	// ShutdownTimeout bounds how long Run waits, once its context is done,
	// for the attempts in flight. After it their contexts are cancelled
	// (their transactions roll back; the messages come again) and Run
	// waits for them to return. Default DefaultShutdownTimeout (30 s).
	ShutdownTimeout time.Duration
}

// Validate reports the first problem with the fields, as an error
// matching inbox.ErrConfig. It does not apply defaults.
func (s Scheduling) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{inbox.ErrConfig}, args...)...)
	}
	switch {
	case s.Concurrency < 0:
		return bad("Concurrency is negative")
	case s.Ordering > ByKey:
		return bad("unknown Ordering %d", s.Ordering)
	case s.MaxBuffered < 0:
		return bad("MaxBuffered is negative")
	case s.BatchSize < 0:
		return bad("BatchSize is negative")
	case s.BatchMaxTime < 0, s.BatchLinger < 0, s.ShutdownTimeout < 0:
		return bad("negative duration (BatchMaxTime, BatchLinger or ShutdownTimeout)")
	}
	return nil
}

// DefaultScheduling returns the defaults every front starts from: the
// Default constants, and BatchLinger 0 and Ordering ByPartition.
func DefaultScheduling() Scheduling {
	return Scheduling{
		Concurrency:     DefaultConcurrency,
		MaxBuffered:     DefaultMaxBuffered,
		BatchSize:       DefaultBatchSize,
		BatchMaxTime:    DefaultBatchMaxTime,
		ShutdownTimeout: DefaultShutdownTimeout,
	}
}

// WithDefaults returns s with each zero field set to d's.
func (s Scheduling) WithDefaults(d Scheduling) Scheduling {
	set := func(v *int, def int) {
		if *v == 0 {
			*v = def
		}
	}
	setDur := func(v *time.Duration, def time.Duration) {
		if *v == 0 {
			*v = def
		}
	}
	set(&s.Concurrency, d.Concurrency)
	set(&s.MaxBuffered, d.MaxBuffered)
	set(&s.BatchSize, d.BatchSize)
	setDur(&s.BatchMaxTime, d.BatchMaxTime)
	setDur(&s.BatchLinger, d.BatchLinger)
	setDur(&s.ShutdownTimeout, d.ShutdownTimeout)
	if s.Ordering == ByPartition {
		s.Ordering = d.Ordering
	}
	return s
}
