package kafkainbox

import (
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// Ordering says which messages must run one after the other when
// Config.Concurrency is above 1.
type Ordering uint8

// Orderings.
const (
	// ByPartition (the default) runs each partition's messages in offset
	// order; different partitions may run at the same time.
	ByPartition Ordering = iota
	// ByKey runs the messages of one key (within a partition) in offset
	// order; different keys of one partition may run at the same time.
	// Messages without a key are ordered by partition.
	ByKey
)

// Defaults of Config.
const (
	// DefaultBatchSize is Config.BatchSize's default: up to 50 messages of
	// a partition that are waiting run in one transaction. It keeps a
	// batch's savepoints (one per message) within the 64 subtransactions
	// Postgres tracks per transaction without overflowing to disk.
	DefaultBatchSize = 50
	// DefaultConcurrency is Config.Concurrency's default: four partitions'
	// messages (or batches) run at once, each in its own transaction on a
	// connection of its own; each partition's messages stay in order.
	DefaultConcurrency = 4
	// DefaultBatchMaxTime is Config.BatchMaxTime's default.
	DefaultBatchMaxTime = 50 * time.Millisecond
	// DefaultBatchLinger was Config.BatchLinger's default when batches
	// were opt-in.
	//
	// Deprecated: batches do not linger unless Config.BatchLinger is set.
	DefaultBatchLinger = 10 * time.Millisecond
	// DefaultCommitInterval is Config.CommitInterval's default.
	DefaultCommitInterval = time.Second
	// DefaultShutdownTimeout is Config.ShutdownTimeout's default.
	DefaultShutdownTimeout = 30 * time.Second
	// DefaultMaxBuffered is Config.MaxBuffered's default.
	DefaultMaxBuffered = 1000

	// DefaultSessionTimeout is the consumer group session timeout the
	// Consumer gives kafka-go (whose own default is 30 s): how long the
	// group coordinator keeps a member that stopped heartbeating, a
	// process that was killed for example. Its partitions, and a restarted
	// process that rejoins, wait that long. It must lie within the
	// brokers' group.min.session.timeout.ms (default 6 s) and
	// group.max.session.timeout.ms (default 30 min).
	DefaultSessionTimeout = 10 * time.Second
	// DefaultRebalanceTimeout is how long the coordinator waits for the
	// members to rejoin during a rebalance (kafka-go's default: 30 s).
	DefaultRebalanceTimeout = 10 * time.Second
	// DefaultHeartbeatInterval is how often a member heartbeats, and so
	// how soon it notices a rebalance (a third of the session timeout at
	// most; kafka-go's default: 3 s).
	DefaultHeartbeatInterval = time.Second
	// DefaultJoinGroupBackoff is the wait after a failed attempt to join
	// the group (kafka-go's default: 5 s).
	DefaultJoinGroupBackoff = time.Second

	// DeadLetterSuffix is appended to the topic to name the dead-letter
	// topic when Config.DeadLetterTopic is empty.
	DeadLetterSuffix = ".dlq"
)

// Config configures a Consumer. Brokers, Topic, GroupID and Processor.Ledger
// are required; everything else has a default.
type Config struct {
	// Brokers to bootstrap from ("host:port"). Required.
	Brokers []string
	// Topic to consume. Required.
	Topic string
	// GroupID of the consumer group. Required. It is also the ledger scope
	// unless Processor.Scope is set.
	GroupID string

	// Processor configures the exactly-once runtime. Ledger is required.
	// Defaults set here: Scope = GroupID, ID = DefaultID,
	// Source = Source ("kafka"), DeadLetter = publish to DeadLetterTopic.
	// The ledger's logger (inbox.Config.Logger) also receives this
	// package's and kafka-go's warnings.
	Processor consumer.Config

	// DeadLetterTopic receives the messages that failed for good, with
	// the consumer.DeadLetterHeadersContext. Default "<Topic>.dlq". The topic must
	// exist or the brokers must auto-create it; until the publish succeeds
	// the message is retried, never dropped. Ignored when
	// Processor.DeadLetter is set.
	DeadLetterTopic string
	// DeadLetterWriter publishes dead letters (its Topic must be empty).
	// Nil: a writer on Brokers with RequiredAcks all, owned and closed by
	// the Consumer. Set it when the brokers need TLS or SASL. It must wait
	// for the brokers' acknowledgement (Async false, RequiredAcks set;
	// RequireAll advised): the message's offset is committed once
	// WriteMessages returns, and kafka-go's zero value (RequireNone)
	// returns before any broker has the dead letter.
	DeadLetterWriter *kafka.Writer

	// Concurrency is how many messages (or batches) may run at once.
	// Default DefaultConcurrency (4), each needing a database connection of
	// its own while it runs: size the pool for it. Messages of one
	// partition run in order whatever the value (see Ordering). A message
	// waiting to be retried holds up only the messages behind it in its
	// partition (or its key, with ByKey), for up to Processor.MaxAttempts backoffs; it does not hold a
	// Concurrency slot while it waits, so the other partitions go on.
	Concurrency int
	// Ordering when Concurrency > 1. Default ByPartition.
	Ordering Ordering
	// MaxBuffered is how many fetched messages may wait to run, across
	// partitions. Messages behind a message waiting to be retried wait
	// here while the other partitions go on; when MaxBuffered are
	// waiting, fetching (of every partition, since they share this
	// buffer) pauses until the retried message is done, acked or
	// dead-lettered. Each partition's reader may hold one more message
	// while it waits for room. Default 1000.
	MaxBuffered int

	// BatchSize is how many messages of one partition (one lane) may run
	// in one transaction. When several fetched messages of a partition are
	// waiting, up to BatchSize of them run in one transaction, each
	// message's claim and handler in its own savepoint
	// (consumer.Processor.ProcessRun), and commit together; a message whose
	// handler fails is rolled back alone, the ones before it commit, and
	// it is retried in place (or dead-lettered) before the ones behind it
	// run, as in per-message mode. A message that is alone in its lane
	// runs at once in a transaction of its own: batches form under load
	// only, and add no latency when the consumer keeps up. Default
	// DefaultBatchSize (50); 1 turns batching off (one message, one
	// transaction).
	BatchSize int
	// BatchMaxTime bounds a batch in time: once its transaction has been
	// running this long it starts no further message and commits what
	// ran (the rest runs in the next batch). Default DefaultBatchMaxTime
	// (50 ms).
	BatchMaxTime time.Duration
	// BatchLinger is how long a batch waits for more messages once it has
	// its first one. Default 0: a batch is what is already fetched, and
	// never waits.
	BatchLinger time.Duration

	// CommitInterval is how often processed offsets are committed to Kafka.
	// A crash or rebalance redelivers at most this much; the ledger skips
	// it. Default 1 s.
	CommitInterval time.Duration
	// ShutdownTimeout bounds how long Run waits, once its context is done,
	// for in-flight handlers. After it, in-flight transactions are
	// cancelled (rolled back; the messages come again), and the final
	// offset commit follows (bounded by kafka-go's group Timeout, 5 s). At
	// a rebalance the wait is the least of ShutdownTimeout and half the
	// rebalance and session timeouts. Default 30 s.
	ShutdownTimeout time.Duration

	// Reader adjusts the kafka-go reader configuration before use (Dialer
	// for TLS/SASL, StartOffset, SessionTimeout, balancers, ...). The
	// Consumer starts from kafka-go's defaults with MaxWait at 1 s and
	// the group timings of DefaultSessionTimeout, DefaultRebalanceTimeout,
	// DefaultHeartbeatInterval and DefaultJoinGroupBackoff, and sets
	// Brokers, Topic and GroupID from this Config and CommitInterval to 0
	// after the call: offsets are committed by the Consumer only. The
	// group fields (GroupID, timings, GroupBalancers, StartOffset,
	// RetentionTime, partition watching, Dialer, loggers) configure the
	// Consumer's kafka-go ConsumerGroup; the rest configures the reader of
	// each assigned partition, whose QueueCapacity is the configured one
	// shared among the partitions (at least 16 each). The Dialer's TLS,
	// SASL and dial function are also used for the requests that tell
	// transaction markers from records.
	//
	// The session timeout trades how fast a dead member's partitions
	// move (and a killed process, restarted, consumes again) against how
	// long a live member may go silent (a long GC pause, a network blip)
	// before the group rebalances without it. A rebalance loses and
	// doubles nothing: the ledger answers Duplicate for what the old owner
	// finished. Raise SessionTimeout (with RebalanceTimeout) for members
	// that stall for longer than 10 s.
	Reader func(*kafka.ReaderConfig)
}

// Validate reports the first problem with the configuration, as an error
// matching inbox.ErrConfig. It does not apply defaults.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: kafkainbox: "+format, append([]any{inbox.ErrConfig}, args...)...)
	}
	switch {
	case len(c.Brokers) == 0:
		return bad("Brokers is empty")
	case c.Topic == "":
		return bad("Topic is empty")
	case c.GroupID == "":
		return bad("GroupID is empty")
	case c.Processor.Ledger == nil:
		return bad("Processor.Ledger is nil")
	case c.Concurrency < 0:
		return bad("Concurrency is negative")
	case c.Ordering > ByKey:
		return bad("unknown Ordering %d", c.Ordering)
	case c.BatchSize < 0:
		return bad("BatchSize is negative")
	case c.MaxBuffered < 0:
		return bad("MaxBuffered is negative")
	case c.BatchLinger < 0, c.BatchMaxTime < 0, c.CommitInterval < 0, c.ShutdownTimeout < 0:
		return bad("negative duration")
	case c.DeadLetterWriter != nil && c.DeadLetterWriter.Topic != "":
		return bad("DeadLetterWriter.Topic must be empty (the Consumer sets each message's topic)")
	case c.DeadLetterWriter != nil && (c.DeadLetterWriter.Async || c.DeadLetterWriter.RequiredAcks == kafka.RequireNone):
		return bad("DeadLetterWriter must wait for the brokers (Async false, RequiredAcks RequireOne or RequireAll): " +
			"the message is acked once its dead letter is written")
	case c.Processor.DeadLetter == nil && c.deadLetterTopic() == c.Topic:
		return bad("DeadLetterTopic is the consumed topic")
	}
	for _, b := range c.Brokers {
		if b == "" {
			return bad("empty broker address")
		}
	}
	return nil
}

func (c Config) deadLetterTopic() string {
	if c.DeadLetterTopic != "" {
		return c.DeadLetterTopic
	}
	return c.Topic + DeadLetterSuffix
}

// withDefaults returns c with every default applied (Processor's own
// defaults are applied by consumer.New).
func (c Config) withDefaults() Config {
	if c.Processor.Scope == "" {
		c.Processor.Scope = c.GroupID
	}
	if c.Processor.ID == nil {
		c.Processor.ID = DefaultID
	}
	if c.Processor.Source == "" {
		c.Processor.Source = Source
	}
	c.DeadLetterTopic = c.deadLetterTopic()
	if c.Concurrency == 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.MaxBuffered == 0 {
		c.MaxBuffered = DefaultMaxBuffered
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.BatchMaxTime == 0 {
		c.BatchMaxTime = DefaultBatchMaxTime
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = DefaultCommitInterval
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	return c
}
