package kafkainbox

import (
	"fmt"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// Defaults of Config. The defaults of its Scheduling are consumer's
// (consumer.DefaultScheduling).
const (
	// DefaultCommitInterval is Config.CommitInterval's default.
	DefaultCommitInterval = time.Second

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

	// Scheduling: Concurrency, Ordering, MaxBuffered, the batches and
	// ShutdownTimeout, with consumer's defaults (see consumer.Scheduling).
	// Here a lane is a partition, or a key bucket of a partition with
	// consumer.ByKey. MaxBuffered is shared by the partitions: when it is
	// reached, fetching pauses for every partition, and each partition's
	// reader may hold one more message while it waits for room. After
	// ShutdownTimeout the final offset commit follows (bounded by
	// kafka-go's group Timeout, 5 s). At a rebalance the wait is the least
	// of ShutdownTimeout and half the rebalance and session timeouts.
	consumer.Scheduling

	// CommitInterval is how often processed offsets are committed to Kafka.
	// A crash or rebalance redelivers at most this much; the ledger skips
	// it. Default 1 s.
	CommitInterval time.Duration
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
	case c.CommitInterval < 0:
		return bad("negative CommitInterval")
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
	if err := c.Scheduling.Validate(); err != nil {
		return fmt.Errorf("kafkainbox: %w", err)
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
	c.Scheduling = c.Scheduling.WithDefaults(consumer.DefaultScheduling())
	if c.CommitInterval == 0 {
		c.CommitInterval = DefaultCommitInterval
	}
	return c
}
