package franzinbox

import (
	"fmt"
	"slices"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// Defaults of Config. The defaults of its Scheduling are consumer's
// (consumer.DefaultScheduling).
const (
	// DefaultCommitInterval is Config.CommitInterval's default.
	DefaultCommitInterval = time.Second

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

	// Scheduling: Concurrency, Ordering, MaxBuffered, the batches and
	// ShutdownTimeout, with consumer's defaults (see consumer.Scheduling).
	// Here a lane is a partition, or a key bucket of a partition with
	// consumer.ByKey; when MaxBuffered messages wait, polling pauses.
	// ShutdownTimeout also bounds the final offset commit.
	consumer.Scheduling

	// CommitInterval is how often processed offsets are committed to Kafka.
	// A crash redelivers at most this much; the ledger skips it. Default
	// 1 s. Offsets are also committed when partitions are revoked and at
	// shutdown.
	CommitInterval time.Duration
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
	case c.CommitInterval < 0:
		return bad("negative CommitInterval")
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
	if err := c.Scheduling.Validate(); err != nil {
		return fmt.Errorf("franzinbox: %w", err)
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
	c.Scheduling = c.Scheduling.WithDefaults(consumer.DefaultScheduling())
	if c.CommitInterval == 0 {
		c.CommitInterval = DefaultCommitInterval
	}
	return c
}
