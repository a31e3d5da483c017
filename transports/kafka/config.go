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
	// DefaultBatchLinger is Config.BatchLinger's default.
	DefaultBatchLinger = 10 * time.Millisecond
	// DefaultCommitInterval is Config.CommitInterval's default.
	DefaultCommitInterval = time.Second
	// DefaultShutdownTimeout is Config.ShutdownTimeout's default.
	DefaultShutdownTimeout = 30 * time.Second
	// DefaultDeadLetterSuffix is appended to the topic to name the
	// dead-letter topic.
	DefaultDeadLetterSuffix = ".dlq"
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
	// Defaults set here: Scope = GroupID, ID = consumer.DefaultKafkaID,
	// Source = inbox.SourceKafka, DeadLetter = publish to DeadLetterTopic.
	// Its Logger also receives this package's and kafka-go's warnings.
	Processor consumer.Config

	// DeadLetterTopic receives the messages that failed for good, with
	// the consumer.DeadLetterHeaders. Default "<Topic>.dlq". The topic must
	// exist or the brokers must auto-create it; until the publish succeeds
	// the message is retried, never dropped. Ignored when
	// Processor.DeadLetter is set.
	DeadLetterTopic string
	// DeadLetterWriter publishes dead letters (its Topic must be empty).
	// Nil: a writer on Brokers with RequiredAcks all, owned and closed by
	// the Consumer. Set it when the brokers need TLS or SASL.
	DeadLetterWriter *kafka.Writer

	// Concurrency is how many messages (or batches) may run at once.
	// Default 1: one at a time, in fetch order. A message being retried
	// in place holds up the messages routed behind it (its partition, or
	// its key with ByKey), for up to Processor.MaxAttempts backoffs.
	Concurrency int
	// Ordering when Concurrency > 1. Default ByPartition.
	Ordering Ordering

	// BatchSize > 0 turns on batch mode: up to BatchSize fetched messages
	// are claimed in one statement and the new ones run in one transaction
	// (consumer.Processor.ProcessBatch). Default 0: one message, one
	// transaction.
	BatchSize int
	// BatchLinger is how long a batch waits for more messages once it has
	// its first one. Default 10 ms.
	BatchLinger time.Duration

	// CommitInterval is how often processed offsets are committed to Kafka.
	// A crash or rebalance redelivers at most this much; the ledger skips
	// it. Default 1 s.
	CommitInterval time.Duration
	// ShutdownTimeout bounds how long Run waits, once its context is done,
	// for in-flight handlers and for the final offset commit. After it,
	// in-flight transactions are cancelled (rolled back; the messages come
	// again). Default 30 s.
	ShutdownTimeout time.Duration

	// Reader adjusts the kafka-go reader configuration before use (Dialer
	// for TLS/SASL, StartOffset, SessionTimeout, balancers, ...). The
	// Consumer starts from kafka-go's defaults with MaxWait and
	// HeartbeatInterval at 1 s, and sets Brokers, Topic and GroupID from this
	// Config and CommitInterval to 0 after the call: offsets are committed
	// by the Consumer only.
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
	case c.BatchLinger < 0, c.CommitInterval < 0, c.ShutdownTimeout < 0:
		return bad("negative duration")
	case c.DeadLetterWriter != nil && c.DeadLetterWriter.Topic != "":
		return bad("DeadLetterWriter.Topic must be empty (the Consumer sets each message's topic)")
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
	return c.Topic + DefaultDeadLetterSuffix
}

// withDefaults returns c with every default applied (Processor's own
// defaults are applied by consumer.New).
func (c Config) withDefaults() Config {
	if c.Processor.Scope == "" {
		c.Processor.Scope = c.GroupID
	}
	if c.Processor.ID == nil {
		c.Processor.ID = consumer.DefaultKafkaID
	}
	if c.Processor.Source == "" {
		c.Processor.Source = inbox.SourceKafka
	}
	c.DeadLetterTopic = c.deadLetterTopic()
	if c.Concurrency == 0 {
		c.Concurrency = 1
	}
	if c.BatchLinger == 0 {
		c.BatchLinger = DefaultBatchLinger
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = DefaultCommitInterval
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	return c
}
