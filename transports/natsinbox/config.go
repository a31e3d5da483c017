package natsinbox

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// Defaults applied by New to zero Config fields. Config.Scheduling's are
// consumer's (consumer.DefaultScheduling) but for Concurrency and
// MaxBuffered, and BatchSize with core NATS (see Config.Scheduling).
const (
	DefaultAckWait     = 30 * time.Second // Config.AckWait (the server's default too)
	DefaultFetchWait   = time.Second      // Config.FetchWait (unused)
	DefaultAckTimeout  = 5 * time.Second  // Config.AckTimeout
	DefaultConcurrency = 1                // Config.Concurrency: the stream's order
	DefaultMaxBuffered = 64               // Config.MaxBuffered

	// DeadLetterSuffix is appended to a message's subject to form its
	// dead-letter subject when Config.DeadLetterSubject is empty.
	DeadLetterSuffix = ".dlq"
)

// Config configures a Consumer. Set Stream and Durable for a JetStream
// consumer, or Subject (and Queue) for a core NATS subscription. The zero
// value of every other field is a usable default.
type Config struct {
	// Conn is the NATS connection. Required. Run neither drains nor closes
	// it: the caller owns it.
	Conn *nats.Conn
	// Processor configures the exactly-once runtime. Ledger is required.
	// Defaults set here: Scope = Durable (JetStream) or Queue, else
	// Subject (core), ID = DefaultID (Nats-Msg-Id first),
	// Source = Source ("nats"), DeadLetter = publish to the dead-letter
	// subject. The ledger's logger (inbox.Config.Logger) also receives this
	// package's warnings.
	Processor consumer.Config

	// Stream is the JetStream stream to consume (JetStream mode).
	Stream string
	// Durable names the durable pull consumer (JetStream mode, required
	// with Stream). Every process running the same Durable shares its
	// messages. It is the default ledger scope.
	Durable string
	// FilterSubjects restricts the consumer to these subjects; empty: the
	// whole stream. Ignored with Bind.
	FilterSubjects []string
	// Bind uses the durable as it is on the server (managed elsewhere)
	// instead of creating or updating it. It must use explicit acks; its
	// AckWait sets the heartbeat, and its MaxDeliver, if set, must not be
	// below Processor.MaxAttempts. Prefer no MaxDeliver: deliveries are
	// not attempts (drains and restarts deliver again), and JetStream stops
	// delivering a message at MaxDeliver without it being dead-lettered.
	Bind bool
	// AckWait is the consumer's ack wait: how long JetStream waits for an
	// ack before delivering again. Default 30 s. Ignored with Bind.
	AckWait time.Duration
	// MaxAckPending caps unacked messages across all members of the
	// durable. Default: the server's (1000). Ignored with Bind.
	MaxAckPending int
	// DoubleAck acks with a confirmed round trip (jetstream.Msg.DoubleAck)
	// instead of a fire-and-forget ack. Slower; a lost ack is harmless
	// anyway (the redelivery is a duplicate), but it is redelivered after
	// AckWait.
	DoubleAck bool
	// AckTimeout bounds DoubleAck and the dead-letter publish. Default 5 s.
	AckTimeout time.Duration
	// Heartbeat is how often a running handler's message is marked
	// InProgress. Default a third of AckWait; negative disables it.
	Heartbeat time.Duration

	// Scheduling: Concurrency, MaxBuffered, the batches and
	// ShutdownTimeout (see consumer.Scheduling), with the defaults of
	// consumer.DefaultScheduling except where NATS differs:
	//
	//   - Concurrency defaults to DefaultConcurrency (1), which keeps the
	//     stream's order apart from redeliveries. Above 1, that many
	//     workers take the next pulled messages, with what waits behind
	//     them, in no order between them. Each worker runs its own
	//     batches.
	//   - Ordering must be consumer.ByPartition: NATS messages have no key.
	//   - MaxBuffered defaults to DefaultMaxBuffered (64): it is how many
	//     messages may wait in the lane, and how many Consume pulls ahead
	//     (jetstream.PullMaxMessages). The consumer takes a pulled message
	//     from the client only when the lane has room, so while it is full
	//     up to MaxBuffered more wait in the client: at most twice
	//     MaxBuffered messages wait, besides the batches running, whatever
	//     the stream's backlog. Messages waiting for a worker are not kept
	//     InProgress: keep 2 × MaxBuffered × handler time / Concurrency
	//     well under AckWait.
	//   - BatchSize batches JetStream's messages (the messages pulled and
	//     waiting, acked one by one after their transaction commits).
	//     Core NATS runs one message per transaction: there BatchSize may
	//     only be 0 or 1, and BatchLinger is not used.
	//   - ShutdownTimeout is how long in-flight handlers keep an
	//     uncancelled context once Run's context is done; then their
	//     contexts are cancelled (their transactions roll back and the
	//     messages are Nak'ed; with core NATS they are lost, and logged).
	//     Run returns once they have returned: a handler that ignores its
	//     context's cancellation holds Run until it returns.
	consumer.Scheduling
	// FetchWait is not used: batches are taken from what Consume has
	// pulled.
	//
	// Deprecated: batching no longer uses Fetch requests.
	FetchWait time.Duration

	// Subject is the core NATS subject (or wildcard) to subscribe to (core
	// mode). Core NATS does not redeliver: see the package documentation.
	Subject string
	// Queue is the core NATS queue group: members of one group share the
	// subject's messages. Empty: a plain subscription.
	Queue string

	// DeadLetterSubject receives the messages that failed for good.
	// Default: the message's subject with DeadLetterSuffix appended.
	// Unused when Processor.DeadLetter is set.
	DeadLetterSubject string

	// ready, for tests, is called once the subscription or the JetStream
	// consumer is in place.
	ready func()
}

// jetStream reports whether the config selects JetStream mode.
func (c *Config) jetStream() bool { return c.Stream != "" }

// withDefaults returns a copy with defaults applied.
func (c Config) withDefaults() Config {
	if c.AckWait <= 0 {
		c.AckWait = DefaultAckWait
	}
	if c.AckTimeout <= 0 {
		c.AckTimeout = DefaultAckTimeout
	}
	if c.FetchWait <= 0 {
		c.FetchWait = DefaultFetchWait
	}
	d := consumer.DefaultScheduling()
	d.Concurrency, d.MaxBuffered = DefaultConcurrency, DefaultMaxBuffered
	if !c.jetStream() {
		d.BatchSize = 0 // one message per transaction
	}
	c.Scheduling = c.Scheduling.WithDefaults(d)
	p := &c.Processor
	if p.Scope == "" {
		switch {
		case c.Durable != "":
			p.Scope = c.Durable
		case c.Queue != "":
			p.Scope = c.Queue
		default:
			p.Scope = c.Subject
		}
	}
	if p.ID == nil {
		p.ID = DefaultID
	}
	if p.Source == "" {
		p.Source = Source
	}
	return c
}

// Validate reports what is wrong with the Config, as an error matching
// inbox.ErrConfig that names the field. Zero values that have a default are
// accepted.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: natsinbox: "+format, append([]any{inbox.ErrConfig}, args...)...))
	}
	if c.Conn == nil {
		bad("Conn is nil")
	}
	if c.Processor.Ledger == nil {
		bad("Processor.Ledger is nil")
	}
	switch {
	case c.Stream != "" && c.Subject != "":
		bad("set Stream (JetStream) or Subject (core NATS), not both")
	case c.Stream == "" && c.Subject == "":
		bad("set Stream and Durable (JetStream) or Subject (core NATS)")
	case c.Stream != "":
		if c.Durable == "" {
			bad("Durable is required with Stream")
		} else if !validName(c.Durable) {
			bad("Durable %q may not contain whitespace, '.', '*', '>', '/' or '\\'", c.Durable)
		}
		if !validName(c.Stream) {
			bad("Stream %q may not contain whitespace, '.', '*', '>', '/' or '\\'", c.Stream)
		}
		if c.Queue != "" {
			bad("Queue is for core NATS; JetStream members share a Durable")
		}
		for _, s := range c.FilterSubjects {
			if !validSubject(s, true) {
				bad("FilterSubjects: invalid subject %q", s)
			}
		}
	default: // core
		if !validSubject(c.Subject, true) {
			bad("Subject: invalid subject %q", c.Subject)
		}
		if c.BatchSize > 1 {
			bad("BatchSize is for JetStream only (core NATS runs one message per transaction)")
		}
		if c.Durable != "" || c.Bind || len(c.FilterSubjects) > 0 {
			bad("Durable, Bind and FilterSubjects are for JetStream only")
		}
	}
	if err := c.Scheduling.Validate(); err != nil {
		errs = append(errs, fmt.Errorf("natsinbox: %w", err))
	}
	if c.Ordering == consumer.ByKey {
		bad("Ordering ByKey needs message keys; NATS messages have none")
	}
	if c.MaxAckPending < 0 {
		bad("MaxAckPending may not be negative")
	}
	if c.DeadLetterSubject != "" && !validSubject(c.DeadLetterSubject, false) {
		bad("DeadLetterSubject: invalid subject %q (no wildcards)", c.DeadLetterSubject)
	}
	if hb := c.Heartbeat; hb > 0 && c.AckWait > 0 && hb >= c.AckWait {
		bad("Heartbeat %s must be shorter than AckWait %s", hb, c.AckWait)
	}
	return errors.Join(errs...)
}

func validName(s string) bool {
	return s != "" && !strings.ContainsAny(s, " \t\r\n.*>/\\")
}

func validSubject(s string, wildcards bool) bool {
	if s == "" || strings.ContainsAny(s, " \t\r\n") {
		return false
	}
	toks := strings.Split(s, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return false
		case t == "*" || t == ">":
			if !wildcards || (t == ">" && i != len(toks)-1) {
				return false
			}
		}
	}
	return true
}

// subjectsCollide reports whether some subject matches both patterns.
func subjectsCollide(a, b string) bool {
	at, bt := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; ; i++ {
		switch {
		case i == len(at) && i == len(bt):
			return true
		case i == len(at) || i == len(bt):
			return false
		case at[i] == ">" || bt[i] == ">":
			return true
		case at[i] != bt[i] && at[i] != "*" && bt[i] != "*":
			return false
		}
	}
}

// checkDeadLetterLoop fails when a consumer of subjects would receive its
// own dead letters.
func (c *Config) checkDeadLetterLoop(subjects []string) error {
	if c.Processor.DeadLetter != nil {
		return nil
	}
	for _, s := range subjects {
		for _, f := range subjects {
			var collide bool
			if c.DeadLetterSubject != "" {
				collide = subjectsCollide(f, c.DeadLetterSubject)
			} else {
				collide = strings.HasSuffix(s, ">") || subjectsCollide(f, s+DeadLetterSuffix)
			}
			if collide {
				dl := c.DeadLetterSubject
				if dl == "" {
					dl = "<subject>" + DeadLetterSuffix
				}
				return fmt.Errorf("%w: natsinbox: dead-letter subject %s would be consumed by this consumer (subjects %s): set DeadLetterSubject outside them, or narrow the subjects",
					inbox.ErrConfig, dl, strings.Join(subjects, ", "))
			}
		}
	}
	return nil
}
