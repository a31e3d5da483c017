package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/inbox"
)

// Handler handles one event inside the ledger's transaction: its writes
// through tx commit together with the event's ledger row, or not at all.
// Return an error to roll back; the event is retried, then dead-lettered.
// Wrap an error with Permanent to dead-letter at once.
type Handler func(ctx context.Context, tx pgx.Tx, m *Message) error

// Middleware wraps a Handler (tracing, logging, timeouts), Watermill-style.
type Middleware func(Handler) Handler

// DeadLetterFunc publishes a message that failed for good (to a Kafka topic,
// a NATS subject, a table), with the cause and attempt count. If it returns
// an error the message is not acked and will come again: nothing is lost.
type DeadLetterFunc func(ctx context.Context, m *Message, cause error) error

// Hooks are told what the runtime does, for metrics and logs. Any may be nil.
type Hooks struct {
	// OnOutcome: the ledger answered (Executed, Duplicate, InFlight, Mismatch).
	OnOutcome func(m *Message, out inbox.Outcome, took time.Duration)
	// OnRetry: attempt failed with err and will be retried.
	OnRetry func(m *Message, err error)
	// OnDeadLetter: the message was dead-lettered after m.Attempt attempts.
	OnDeadLetter func(m *Message, cause error)
}

// Backoff is exponential backoff with jitter: attempt n waits a random time
// between half and all of min(Initial·Multiplier^(n-1), Max).
type Backoff struct {
	Initial    time.Duration // default 100 ms
	Max        time.Duration // default 30 s
	Multiplier float64       // default 2
}

// Delay returns the wait after the given failed attempt (from 1).
func (b Backoff) Delay(attempt int) time.Duration {
	if b.Initial <= 0 {
		b.Initial = 100 * time.Millisecond
	}
	if b.Max <= 0 {
		b.Max = 30 * time.Second
	}
	if b.Multiplier < 1 {
		b.Multiplier = 2
	}
	d := float64(b.Initial)
	for i := 1; i < attempt && d < float64(b.Max); i++ {
		d *= b.Multiplier
	}
	if d > float64(b.Max) {
		d = float64(b.Max)
	}
	half := time.Duration(d / 2)
	return half + mrand.N(half+1)
}

// Config configures a Processor.
type Config struct {
	// Ledger records each event. Required.
	Ledger *inbox.Ledger
	// Scope of the ledger keys: the consumer group by default (transports
	// set it). An HTTP route or another consumer naming the same scope
	// shares dedupe with this one. Required.
	Scope string
	// Tenant extracts the tenant from a message. Nil: no tenants.
	Tenant func(*Message) string
	// ID extracts the event ID. Transports set their default (Kafka:
	// DefaultKafkaID; NATS: DefaultNATSID).
	ID IDFunc
	// AllowNoID runs messages without an ID in a plain transaction, with no
	// dedupe. Default false: they are dead-lettered.
	AllowNoID bool
	// Source is recorded in the ledger (kafka, nats, ...).
	Source inbox.Source
	// TTL of ledger rows; 0 uses the ledger default. Keep it longer than
	// the redelivery horizon (Kafka retention you may replay, JetStream
	// MaxAge).
	TTL time.Duration
	// MaxAttempts before dead-lettering. Default 5.
	MaxAttempts int
	// Backoff between attempts.
	Backoff Backoff
	// StoreBackoff between attempts while the database is unreachable;
	// those attempts do not count toward MaxAttempts. Default 200 ms to 5 s.
	StoreBackoff Backoff
	// Retryable decides whether a handler error is worth retrying. Default:
	// every error except those wrapped with Permanent.
	Retryable func(error) bool
	// DeadLetter publishes a message that failed for good. Nil: the failure
	// is only recorded in the ledger (status failed) and logged.
	DeadLetter DeadLetterFunc
	// Middleware wraps the handler, outermost first.
	Middleware []Middleware
	// Hooks observe the runtime.
	Hooks Hooks
	// Logger; nil is silent. Event IDs are masked.
	Logger *slog.Logger
}

// Processor runs one handler over messages with exactly-once effects.
type Processor struct {
	cfg Config
	h   Handler
}

// New returns a Processor for h.
func New(cfg Config, h Handler) (*Processor, error) {
	if cfg.Ledger == nil {
		return nil, fmt.Errorf("%w: Ledger is nil", inbox.ErrConfig)
	}
	if cfg.Scope == "" {
		return nil, fmt.Errorf("%w: Scope is empty", inbox.ErrConfig)
	}
	if h == nil {
		return nil, fmt.Errorf("%w: nil handler", inbox.ErrConfig)
	}
	if cfg.ID == nil {
		cfg.ID = FirstID(DefaultKafkaID, DefaultNATSID)
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 5
	}
	if cfg.StoreBackoff.Initial == 0 {
		cfg.StoreBackoff = Backoff{Initial: 200 * time.Millisecond, Max: 5 * time.Second}
	}
	if cfg.Retryable == nil {
		cfg.Retryable = func(err error) bool { return !IsPermanent(err) }
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	for i := len(cfg.Middleware) - 1; i >= 0; i-- {
		h = cfg.Middleware[i](h)
	}
	return &Processor{cfg: cfg, h: h}, nil
}

// Config returns the processor's configuration, with defaults applied.
func (p *Processor) Config() Config { return p.cfg }

// Action is what the transport should do with a message.
type Action uint8

// Actions.
const (
	// Ack: the message is done (ran now, was a duplicate, or was
	// dead-lettered): ack it / commit its offset.
	Ack Action = iota + 1
	// Retry: not done; deliver it again after Decision.Delay (NATS:
	// NakWithDelay; Kafka: retry in place, keeping partition order).
	Retry
	// Stop: the context ended mid-way; neither ack nor nak. The message
	// comes again after a restart or rebalance, and the ledger dedupes it.
	Stop
)

var actionNames = [...]string{"", "ack", "retry", "stop"}

func (a Action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return "unknown"
}

// Decision is the result of one attempt.
type Decision struct {
	Action Action
	// Delay before the retry (Retry only).
	Delay time.Duration
	// Outcome from the ledger, when it answered.
	Outcome inbox.Outcome
	// DeadLettered: the message failed for good and was dead-lettered.
	DeadLettered bool
	// Counted: the attempt counts toward MaxAttempts (the handler failed);
	// false for retries caused by the database or an in-flight duplicate.
	Counted bool
	// Err is why the attempt did not succeed (Retry, DeadLettered, Stop).
	Err error
}

// permanentError marks an error not worth retrying.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// Permanent marks err as not worth retrying: the message is dead-lettered
// at once.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool {
	var p permanentError
	return errors.As(err, &p)
}

// PanicError is a handler panic turned into an error.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("handler panicked: %v", e.Value) }

type resultKey struct{}

// SetResult records res as the event's result in the ledger, so that an
// HTTP retry with the same key in the same scope replays it. Call it from a
// Handler; it does nothing elsewhere.
func SetResult(ctx context.Context, res inbox.Result) {
	if slot, ok := ctx.Value(resultKey{}).(*inbox.Result); ok {
		*slot = res
	}
}

func (p *Processor) request(m *Message) inbox.Request {
	r := inbox.Request{Key: inbox.Key{Scope: p.cfg.Scope, ID: m.ID}, Source: p.cfg.Source, TTL: p.cfg.TTL, LockWait: -1}
	if p.cfg.Tenant != nil {
		r.Tenant = p.cfg.Tenant(m)
	}
	return r
}

// call runs the handler with the result slot, turning a panic into an
// error (the ledger has rolled back by then).
func (p *Processor) call(ctx context.Context, tx pgx.Tx, m *Message) (res inbox.Result, err error) {
	ctx = context.WithValue(ctx, resultKey{}, &res)
	return res, p.h(ctx, tx, m)
}

func recovered(err *error) {
	if v := recover(); v != nil {
		*err = &PanicError{Value: v, Stack: debug.Stack()}
	}
}

// Process makes one attempt at m: extract the ID, claim it and run the
// handler in one transaction, and decide. m.Attempt must be the delivery
// attempt (from 1); after MaxAttempts failed attempts (or a Permanent
// error) the message is dead-lettered and acked.
func (p *Processor) Process(ctx context.Context, m *Message) Decision {
	if m.Attempt < 1 {
		m.Attempt = 1
	}
	if m.ID == "" {
		id, err := p.cfg.ID(m)
		if err != nil || id == "" {
			if err == nil {
				err = ErrNoID
			}
			if p.cfg.AllowNoID {
				return p.runUndeduped(ctx, m)
			}
			return p.deadLetter(ctx, m, err, false)
		}
		m.ID = id
	}
	req := p.request(m)
	if err := p.cfg.Ledger.Validate(req); err != nil {
		return p.deadLetter(ctx, m, err, false)
	}
	start := time.Now()
	var out inbox.Outcome
	var err error
	func() {
		defer recovered(&err)
		out, err = p.cfg.Ledger.Do(ctx, req, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			return p.call(ctx, tx, m)
		})
	}()
	return p.decide(ctx, m, req, out, err, time.Since(start))
}

func (p *Processor) decide(ctx context.Context, m *Message, req inbox.Request, out inbox.Outcome, err error, took time.Duration) Decision {
	switch {
	case err == nil && out.Disposition == inbox.InFlight:
		p.outcome(m, out, took)
		// Another consumer (a zombie after a rebalance, another path) holds
		// the key: come back when it is done.
		return p.retry(m, Decision{Outcome: out, Delay: p.cfg.StoreBackoff.Delay(1), Err: errInFlight})
	case err == nil:
		p.outcome(m, out, took)
		return Decision{Action: Ack, Outcome: out}
	case ctx.Err() != nil:
		return Decision{Action: Stop, Err: err}
	case inbox.IsTransient(err):
		p.cfg.Logger.Warn("justonce consumer: database unavailable, will retry", "id", inbox.Mask(m.ID), "err", err)
		return p.retry(m, Decision{Delay: p.cfg.StoreBackoff.Delay(m.Attempt), Err: err})
	case !p.cfg.Retryable(err) || m.Attempt >= p.cfg.MaxAttempts:
		return p.deadLetter(ctx, m, err, true)
	default:
		return p.retry(m, Decision{Delay: p.cfg.Backoff.Delay(m.Attempt), Counted: true, Err: err})
	}
}

var errInFlight = errors.New("justonce/consumer: event in flight elsewhere")

func (p *Processor) retry(m *Message, d Decision) Decision {
	d.Action = Retry
	if p.cfg.Hooks.OnRetry != nil {
		p.cfg.Hooks.OnRetry(m, d.Err)
	}
	return d
}

func (p *Processor) outcome(m *Message, out inbox.Outcome, took time.Duration) {
	if p.cfg.Hooks.OnOutcome != nil {
		p.cfg.Hooks.OnOutcome(m, out, took)
	}
}

// deadLetter publishes m and records it failed, then acks. If publishing
// fails the message is retried instead: it is never dropped.
func (p *Processor) deadLetter(ctx context.Context, m *Message, cause error, keyed bool) Decision {
	if p.cfg.DeadLetter != nil {
		if err := p.cfg.DeadLetter(ctx, m, cause); err != nil {
			if ctx.Err() != nil {
				return Decision{Action: Stop, Err: err}
			}
			p.cfg.Logger.Warn("justonce consumer: dead-letter publish failed, will retry", "id", inbox.Mask(m.ID), "err", err)
			return p.retry(m, Decision{Delay: p.cfg.StoreBackoff.Delay(1), Err: fmt.Errorf("dead letter: %w (cause: %w)", err, cause)})
		}
	} else {
		p.cfg.Logger.Error("justonce consumer: message failed for good", "id", inbox.Mask(m.ID), "topic", m.Topic, "attempts", m.Attempt, "err", cause)
	}
	if keyed {
		if _, err := p.cfg.Ledger.RecordFailure(ctx, p.request(m), m.Attempt, cause); err != nil {
			// Published but not recorded: a redelivery fails and is
			// dead-lettered again (dead letters are at-least-once).
			p.cfg.Logger.Warn("justonce consumer: recording failure", "id", inbox.Mask(m.ID), "err", err)
		}
	}
	if p.cfg.Hooks.OnDeadLetter != nil {
		p.cfg.Hooks.OnDeadLetter(m, cause)
	}
	return Decision{Action: Ack, DeadLettered: true, Err: cause}
}

// runUndeduped runs a message that has no ID in a plain transaction.
func (p *Processor) runUndeduped(ctx context.Context, m *Message) Decision {
	var err error
	func() {
		defer recovered(&err)
		err = pgx.BeginFunc(ctx, p.cfg.Ledger.Pool(), func(tx pgx.Tx) error {
			_, err := p.call(ctx, tx, m)
			return err
		})
	}()
	if err == nil {
		return Decision{Action: Ack, Outcome: inbox.Outcome{Disposition: inbox.Executed}}
	}
	return p.decide(ctx, m, inbox.Request{}, inbox.Outcome{}, err, 0)
}

// ProcessWithRetry processes m until it is done: it retries in place with
// backoff (counting m.Attempt up on handler failures) and returns the final
// Decision, Ack or Stop. Transports that must keep order (a Kafka
// partition) use it.
func (p *Processor) ProcessWithRetry(ctx context.Context, m *Message) Decision {
	for {
		d := p.Process(ctx, m)
		if d.Action != Retry {
			return d
		}
		if d.Counted {
			m.Attempt++
		}
		t := time.NewTimer(d.Delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return Decision{Action: Stop, Err: ctx.Err()}
		case <-t.C:
		}
	}
}
