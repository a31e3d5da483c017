package franzinbox

import (
	"fmt"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

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
	// DefaultCommitInterval is Config.CommitInterval's default.
	DefaultCommitInterval = time.Second
	// DefaultShutdownTimeout is Config.ShutdownTimeout's default.
	DefaultShutdownTimeout = 30 * time.Second
	// DefaultMaxBuffered is Config.MaxBuffered's default.
	DefaultMaxBuffered = 1000

	// DefaultSessionTimeout is the consumer group session timeout the
	// Consumer gives franz-go (whose own default is 45 s): how long the
	// group coordinator keeps a member that stopped heartbeating, a
	// process that was killed for example. Its partitions, and a restarted
	// process that rejoins, wait that long. It must lie within the
	// brokers' group.min.session.timeout.ms (default 6 s) and
	// group.max.session.timeout.ms (default 30 min).
	DefaultSessionTimeout = 10 * time.Second
	// DefaultRebalanceTimeout is how long the coordinator waits for the
	// members to rejoin during a rebalance (franz-go's default: 60 s). A
	// member whose partitions are revoked waits up to half of it for its
	// handlers of those partitions to finish (see the package doc).
	DefaultRebalanceTimeout = 10 * time.Second
	// DefaultHeartbeatInterval is how often a member heartbeats, and so
	// how soon it notices a rebalance (franz-go's default: 3 s).
	DefaultHeartbeatInterval = time.Second

	// DeadLetterSuffix is appended to a message's topic to name its
	// dead-letter topic when Config.DeadLetterTopic is empty.
	DeadLetterSuffix = ".dlq"
)

// Config configures a Consumer. Brokers, Topics, GroupID and
// Processor.Ledger are required; everything else has a default.
type Config struct {
	// Brokers to bootstrap from ("host:port"). Required.
	Brokers []string
	// Topics to consume. Required. The ledger scope is shared by all of
	// them: an event ID published to two of the topics runs once.
	Topics []string
	// GroupID of the consumer group. Required. It is also the ledger scope
	// unless Processor.Scope is set.
	GroupID string

	// Processor configures the exactly-once runtime. Ledger is required.
	// Defaults set here: Scope = GroupID, ID = DefaultID,
	// Source = Source ("kafka"), DeadLetter = publish to the dead-letter
	// topic. The ledger's logger (inbox.Config.Logger) also receives this
	// package's and franz-go's warnings.
	Processor consumer.Config

	// DeadLetterTopic receives the messages that failed for good, with
	// the consumer.DeadLetterHeadersContext. Default: "<topic>.dlq", where topic
	// is the message's own. The topic must exist or the brokers must
	// auto-create it; until the publish succeeds the message is retried,
	// never dropped. Dead letters are produced by the Consumer's client
	// (acks from all in-sync replicas, idempotent). Ignored when
	// Processor.DeadLetter is set.
	DeadLetterTopic string

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
	// waiting, polling pauses until the retried message is done, acked or
	// dead-lettered. Default 1000.
	MaxBuffered int

	// BatchSize is how many messages of one partition (one lane) may run
	// in one transaction. When several polled messages of a partition are
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
	// its first one. Default 0: a batch is what is already polled, and
	// never waits.
	BatchLinger time.Duration

	// CommitInterval is how often processed offsets are committed to Kafka.
	// A crash redelivers at most this much; the ledger skips it. Default
	// 1 s. Offsets are also committed when partitions are revoked and at
	// shutdown.
	CommitInterval time.Duration
	// ShutdownTimeout bounds how long Run waits, once its context is done,
	// for in-flight handlers and for the final offset commit. After it,
	// in-flight transactions are cancelled (rolled back; the messages come
	// again). Default 30 s.
	ShutdownTimeout time.Duration

	// ClientOptions are added to the franz-go client's options: TLS
	// (kgo.DialTLSConfig), SASL (kgo.SASL), group timings
	// (kgo.SessionTimeout, kgo.RebalanceTimeout, kgo.HeartbeatInterval),
	// where a new group starts (kgo.ConsumeResetOffset; default: the
	// oldest offset), fetch sizes, the balancer. They come after the
	// Consumer's defaults (DefaultSessionTimeout, DefaultRebalanceTimeout,
	// DefaultHeartbeatInterval, a 1 s fetch wait, a logger writing to the
	// ledger's) and before the options the Consumer needs and sets last:
	// the seed brokers, group and topics of this Config, read-committed
	// isolation, no auto-commit (the Consumer commits, after the ledger
	// did), rebalances blocked while a poll is handed out, and its
	// revoke and lost callbacks.
	ClientOptions []kgo.Opt
}

// Validate reports the first problem with the configuration, as an error
// matching inbox.ErrConfig. It does not apply defaults.
func (c Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: franzinbox: "+format, append([]any{inbox.ErrConfig}, args...)...)
	}
	switch {
	case len(c.Brokers) == 0:
		return bad("Brokers is empty")
	case len(c.Topics) == 0:
		return bad("Topics is empty")
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
	case c.Processor.DeadLetter == nil && c.DeadLetterTopic != "" && slices.Contains(c.Topics, c.DeadLetterTopic):
		return bad("DeadLetterTopic %q is a consumed topic", c.DeadLetterTopic)
	}
	for _, b := range c.Brokers {
		if b == "" {
			return bad("empty broker address")
		}
	}
	for _, t := range c.Topics {
		switch {
		case t == "":
			return bad("empty topic name")
		case c.Processor.DeadLetter == nil && c.DeadLetterTopic == "" && slices.Contains(c.Topics, t+DeadLetterSuffix):
			return bad("topic %q is the dead-letter topic of %q", t+DeadLetterSuffix, t)
		}
	}
	return nil
}

// deadLetterTopic is where m's dead letter goes.
func (c Config) deadLetterTopic(topic string) string {
	if c.DeadLetterTopic != "" {
		return c.DeadLetterTopic
	}
	return topic + DeadLetterSuffix
}

// withDefaults returns c with every default applied (Processor's own
// defaults are applied by consumer.New).
func (c Config) withDefaults() Config {
	c.Brokers = slices.Clone(c.Brokers)
	c.Topics = slices.Clone(c.Topics)
	c.ClientOptions = slices.Clone(c.ClientOptions)
	if c.Processor.Scope == "" {
		c.Processor.Scope = c.GroupID
	}
	if c.Processor.ID == nil {
		c.Processor.ID = DefaultID
	}
	if c.Processor.Source == "" {
		c.Processor.Source = Source
	}
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
