package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/inbox"
)

// Handler handles one event inside the ledger's transaction: its writes
// through tx commit together with the event's ledger row, or not at all.
// Return an error to roll back; the event is retried, then dead-lettered.
// Wrap an error with Permanent to dead-letter at once. With Config.Steps
// the handler runs in steps instead: tx is nil and Steps(ctx) returns the
// event's *inbox.Steps.
type Handler func(ctx context.Context, tx pgx.Tx, m *Message) error

// Middleware wraps a Handler (tracing, logging, timeouts), Watermill-style.
type Middleware func(Handler) Handler

// Hooks are told what the runtime does, for metrics and logs. Any may be nil.
type Hooks struct {
	// OnOutcome: the ledger answered (Executed, Duplicate, InFlight, Mismatch).
	OnOutcome func(m *Message, out inbox.Outcome, took time.Duration)
	// OnRetry: attempt failed with err and will be retried.
	OnRetry func(m *Message, err error)
	// OnDeadLetter: the message was dead-lettered after m.Attempt attempts.
	OnDeadLetter func(m *Message, cause error)
	// OnHorizon: a front's Run, at start, measured a topic's (or
	// stream's) redelivery horizon against the ledger's TTL (see
	// Config.Horizon); once per topic, before Run consumes.
	OnHorizon func(h Horizon)
	// OnObserve: in observe mode (Config.Observe), what dedupe would have
	// done with an attempt at m that ran anyway: WouldRun, WouldSkip,
	// WouldConflict, WouldRefuseMissingKey or WouldRefuseInvalidKey.
	OnObserve func(m *Message, would string)
}

// DefaultBackoffMax is the longest wait between a message's attempts when
// Config.Backoff.Max is unset: 30 s, backoff.DefaultMax. (The HTTP and gRPC
// clients wait at most 5 s, as a caller is waiting for them.)
const DefaultBackoffMax = 30 * time.Second

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
	// DefaultID; NATS: natsinbox.DefaultID). Default: DefaultID.
	ID IDFunc
	// AllowNoID runs messages without an ID in a plain transaction, with no
	// dedupe. Default false: they are dead-lettered.
	AllowNoID bool
	// Source is recorded in the ledger (each front sets its own: kafka,
	// nats, ...).
	Source inbox.Source
	// TTL of ledger rows; 0 uses the ledger default. Keep it longer than
	// the redelivery horizon: how long the broker may still deliver a
	// message (Kafka: the topic's retention.ms plus segment.ms; JetStream:
	// the stream's MaxAge). See Horizon.
	TTL time.Duration
	// Horizon is what the consumer fronts do when Run starts: they ask
	// the broker how long it keeps the messages they consume (and how far
	// behind their group is), compare it with TTL, report it to
	// Hooks.OnHorizon, and with HorizonWarn (the default) log a warning
	// when the broker may deliver a message after the ledger forgot its
	// ID, or with HorizonRefuse return a *HorizonError from Run instead of
	// consuming. HorizonOff asks nothing. A check that could not be made
	// is logged; it never stops Run.
	Horizon HorizonPolicy
	// MaxAttempts before dead-lettering: failures of the handler (an error,
	// a panic, a data or constraint error, a transaction it left aborted, a
	// deferred constraint failing at COMMIT) count. Default 5.
	MaxAttempts int
	// MaxUncounted bounds the retries of one message that do not count
	// although its handler ran: the connection was lost mid-handler or at
	// COMMIT, or the transaction lost a serialization or deadlock race.
	// Beyond it, each such failure counts as an attempt, so a handler that
	// always breaks its own connection or always loses its race is
	// dead-lettered in the end instead of retried forever. Attempts whose
	// handler never ran (the ledger could not reach the database) never
	// count, however long the outage. Default 50.
	MaxUncounted int
	// Backoff between attempts. Unset fields: 100 ms, DefaultBackoffMax
	// (30 s), multiplier 2.
	Backoff backoff.Backoff
	// StoreBackoff between attempts while the database is unreachable;
	// those attempts do not count toward MaxAttempts. The delay grows with
	// each failure of the outage, across all the processor's messages, and
	// starts again from Initial once the database answers. Default, when
	// its Initial is unset: 200 ms to 5 s, multiplier 2.
	StoreBackoff backoff.Backoff
	// Retryable decides whether a handler error is worth retrying. Default:
	// every error except those wrapped with Permanent.
	Retryable func(error) bool
	// DeadLetter publishes a message that failed for good (to a topic, a
	// subject, a table), with the cause; m.Attempt is the attempts made.
	// Until it returns nil the publish is retried, with StoreBackoff, and
	// the message is not acked: nothing is lost. Each front sets its own
	// (a dead-letter topic or subject). Nil: the failure is only recorded
	// in the ledger (status failed) and logged.
	DeadLetter func(ctx context.Context, m *Message, cause error) error
	// Observe runs the consumer as the at-least-once consumer it
	// replaces: every message's handler runs, duplicates too, while the
	// ledger records each message's ID, under the scope Scope +
	// ObserveSuffix, so that Hooks.OnObserve and the log say what dedupe
	// would have done (a duplicate it would have skipped, or an ID in
	// flight, at INFO; a message it would have dead-lettered for its ID,
	// at WARN). Those IDs never meet an enforcing consumer's: switching to
	// enforce starts from no IDs. See observe.go. Default false.
	Observe bool
	// Steps runs each event's handler in steps (inbox.Ledger.DoSteps)
	// instead of in one transaction: the handler gets a nil tx and reaches
	// the event's *inbox.Steps with Steps(ctx), to record Postgres steps
	// (Steps.Tx, exactly once) and outside steps (Steps.Call, at least
	// once, with a key of their own). A failed attempt keeps the recorded
	// steps and is retried as usual (Backoff, MaxAttempts): the next one
	// resumes after them. A failure that dead-letters (a Permanent error,
	// an error Retryable refuses, the last attempt's error) first runs the
	// compensations the handler declared (Steps.Compensate), in reverse
	// order, and records the key failed. Each event runs alone, under its
	// own lease (inbox.Config.LeaseDuration): the fronts never batch a
	// steps handler into a shared transaction. Default false.
	Steps bool
	// Middleware wraps the handler, outermost first.
	Middleware []Middleware
	// Hooks observe the runtime.
	Hooks Hooks
}

// Processor runs one handler over messages with exactly-once effects. It
// logs through the ledger's logger (inbox.Config.Logger), with event IDs
// masked; an outage of the database logs one warning when it starts and
// one info line when it ends, not one line per retry.
type Processor struct {
	cfg Config
	h   Handler
	log *slog.Logger
	out outage
}

// outage tracks an episode of database unavailability: consecutive
// attempts that failed because the database could not be reached.
type outage struct {
	active atomic.Bool // fails > 0: read without the lock on every success
	mu     sync.Mutex
	fails  int       // failed attempts since the episode started; 0: no outage
	since  time.Time // when the episode started
}

// New returns a Processor for h.
func New(cfg Config, h Handler) (*Processor, error) {
	if cfg.Ledger == nil {
		return nil, fmt.Errorf("%w: Ledger is nil", inbox.ErrConfig)
	}
	if cfg.Scope == "" {
		return nil, fmt.Errorf("%w: Scope is empty", inbox.ErrConfig)
	}
	if cfg.Horizon > HorizonOff {
		return nil, fmt.Errorf("%w: unknown Horizon %s", inbox.ErrConfig, cfg.Horizon)
	}
	if h == nil {
		return nil, fmt.Errorf("%w: nil handler", inbox.ErrConfig)
	}
	if cfg.Steps && cfg.AllowNoID {
		return nil, fmt.Errorf("%w: Steps and AllowNoID: steps need an event ID", inbox.ErrConfig)
	}
	if cfg.ID == nil {
		cfg.ID = DefaultID
	}
	if cfg.MaxAttempts <= 0 {
		cfg.MaxAttempts = 5
	}
	if cfg.MaxUncounted <= 0 {
		cfg.MaxUncounted = 50
	}
	cfg.Backoff = cfg.Backoff.Or(backoff.Backoff{Max: DefaultBackoffMax})
	if cfg.StoreBackoff.Initial == 0 {
		cfg.StoreBackoff = backoff.Backoff{Initial: 200 * time.Millisecond, Max: 5 * time.Second}
	}
	if cfg.Retryable == nil {
		cfg.Retryable = func(err error) bool { return !IsPermanent(err) }
	}
	for i := len(cfg.Middleware) - 1; i >= 0; i-- {
		h = cfg.Middleware[i](h)
	}
	log := cfg.Ledger.Logger()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Processor{cfg: cfg, h: h, log: log}, nil
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
	// The caller adds one to Message.Attempt before the next attempt
	// (Retry does).
	Counted bool
	// HandlerRan: the handler was called in this attempt. A retry that does
	// not count although the handler ran added one to Message.Uncounted.
	HandlerRan bool
	// Err is why the attempt did not succeed (Retry, DeadLettered, Stop).
	// For Stop it matches the context's error with errors.Is.
	Err error

	at time.Time // when a Retry was decided: its Delay counts from here
}

// Permanent marks err as not worth retrying: the message is dead-lettered
// at once. It is inbox.Permanent, so there is one notion of permanent: the
// result matches inbox.ErrPermanent, and a handler run in steps
// (Config.Steps) that returns it has its completed steps compensated
// before the message is dead-lettered. The error reads and unwraps as err; Permanent(nil) is
// nil.
func Permanent(err error) error { return inbox.Permanent(err) }

// IsPermanent reports whether err was marked with Permanent (or
// inbox.Permanent): errors.Is(err, inbox.ErrPermanent).
func IsPermanent(err error) bool { return errors.Is(err, inbox.ErrPermanent) }

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
	r := inbox.Request{Key: inbox.Key{Scope: p.scope(), ID: m.ID}, Source: p.cfg.Source, TTL: p.cfg.TTL}
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
// handler in one transaction, and decide.
//
// m.Attempt is the handler attempt (from 1): after a Decision with Counted
// set the caller adds one before the next attempt. After MaxAttempts
// counted failures (or a Permanent error) the message is dead-lettered,
// recorded failed in the ledger, and acked. Process itself adds one to
// m.Uncounted when a retry does not count although the handler ran (see
// Config.MaxUncounted). A context that has ended gives Stop with the
// context's error; work that committed before is still acked.
func (p *Processor) Process(ctx context.Context, m *Message) Decision {
	if m.Attempt < 1 {
		m.Attempt = 1
	}
	if err := ctx.Err(); err != nil {
		return Decision{Action: Stop, Err: err}
	}
	if p.cfg.Observe {
		return p.observe(ctx, m)
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
	if p.cfg.Steps {
		return p.processSteps(ctx, m, req)
	}
	start := time.Now()
	var out inbox.Outcome
	var err error
	ran := false
	func() {
		defer recovered(&err)
		out, err = p.cfg.Ledger.Do(ctx, req, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			ran = true
			return p.call(ctx, tx, m)
		})
	}()
	return p.decide(ctx, m, out, err, time.Since(start), ran)
}

// decide turns the ledger's answer into a Decision. ran says whether the
// handler was called in this attempt.
func (p *Processor) decide(ctx context.Context, m *Message, out inbox.Outcome, err error, took time.Duration, ran bool) Decision {
	switch {
	case err == nil && out.Disposition == inbox.InFlight:
		p.available()
		if ctx.Err() != nil {
			return Decision{Action: Stop, Outcome: out, Err: ctx.Err()}
		}
		p.outcome(m, out, took)
		// Another consumer (a zombie after a rebalance, another path) holds
		// the key: come back when it is done.
		return p.retry(m, Decision{Outcome: out, Delay: p.cfg.StoreBackoff.Delay(1), Err: errInFlight})
	case err == nil:
		// Done (or done before): ack, even if ctx ended since.
		p.available()
		p.outcome(m, out, took)
		return Decision{Action: Ack, Outcome: out, HandlerRan: ran}
	case ctx.Err() != nil:
		return Decision{Action: Stop, Err: stopErr(ctx, err), HandlerRan: ran}
	case !ran && ledgerFault(err):
		// The ledger could not claim the event, for a reason that is not
		// the event's: its table or a privilege is missing, the database
		// refuses writes, the layout refuses the transaction. Every event
		// would fail the same way: wait as through an outage rather than
		// dead-letter the stream.
		return p.transient(ctx, m, err, ran, p.unavailable(err))
	case !inbox.IsTransient(err):
		if ran {
			p.available() // the claim went through: the database answers
		}
		return p.fail(ctx, m, err, ran)
	}
	return p.transient(ctx, m, err, ran, p.transientDelay(m.Uncounted, err))
}

// transientDelay is the wait before retrying after a transient error: the
// outage's backoff when the database is unreachable, the handler backoff
// after a lost race.
func (p *Processor) transientDelay(uncounted int, err error) time.Duration {
	if lostRace(err) {
		p.available()
		return p.cfg.Backoff.Delay(uncounted + 1)
	}
	return p.unavailable(err)
}

// transient decides an attempt that failed for a transient reason: retried
// without counting, unless the handler ran and the message has used up
// MaxUncounted such retries.
func (p *Processor) transient(ctx context.Context, m *Message, err error, ran bool, delay time.Duration) Decision {
	if ran {
		m.Uncounted++
		if m.Uncounted > p.cfg.MaxUncounted {
			err = fmt.Errorf("%w (retried %d times without counting an attempt)", err, m.Uncounted-1)
			d := p.fail(ctx, m, err, ran)
			if d.Action == Retry {
				d.Delay = max(d.Delay, delay)
			}
			return d
		}
	}
	p.log.DebugContext(ctx, "justonce consumer: retrying without counting an attempt", "id", inbox.Mask(m.ID), "delay", delay, "err", err)
	return p.retry(m, Decision{Delay: delay, Err: err, HandlerRan: ran})
}

// fail decides a counted failure: retry with backoff, or dead-letter after
// the last attempt or a non-retryable error.
func (p *Processor) fail(ctx context.Context, m *Message, err error, ran bool) Decision {
	if !p.cfg.Retryable(err) || m.Attempt >= p.cfg.MaxAttempts {
		d := p.deadLetter(ctx, m, err, m.ID != "")
		d.HandlerRan = ran
		return d
	}
	return p.retry(m, Decision{Delay: p.cfg.Backoff.Delay(m.Attempt), Counted: true, Err: err, HandlerRan: ran})
}

// stopErr is err for a Stop: it matches ctx's error.
func stopErr(ctx context.Context, err error) error {
	cerr := ctx.Err()
	switch {
	case err == nil:
		return cerr
	case errors.Is(err, cerr):
		return err
	}
	return fmt.Errorf("%w: %w", cerr, err)
}

// ledgerFault reports whether err is a ledger step's failure (the claim,
// before any handler ran) that says nothing about the event: any but a
// data or constraint error (SQLSTATE classes 22 and 23), which an event's
// key can cause. A TTL the ledger refuses (22023) is the configuration's,
// the same for every event.
func ledgerFault(err error) bool {
	var se *inbox.StoreError
	if !errors.As(err, &se) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code != "22023" {
		return !strings.HasPrefix(pgErr.Code, "22") && !strings.HasPrefix(pgErr.Code, "23")
	}
	return true
}

// lostRace reports whether err is a serialization failure or a deadlock:
// the database answered, the transaction lost a race it may win next time.
func lostRace(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}

// unavailable records a failed attempt of the current outage (starting
// one, with a warning, if there is none) and returns the wait before the
// next attempt, which grows with the outage's failures.
func (p *Processor) unavailable(err error) time.Duration {
	p.out.mu.Lock()
	p.out.fails++
	n := p.out.fails
	if n == 1 {
		p.out.since = time.Now()
		p.out.active.Store(true)
	}
	p.out.mu.Unlock()
	if n == 1 {
		p.log.Warn("justonce consumer: database unavailable; retrying with backoff until it answers",
			"scope", p.cfg.Scope, "err", err)
	}
	return p.cfg.StoreBackoff.Delay(n)
}

// available ends the current outage, if any, with an info line.
func (p *Processor) available() {
	if !p.out.active.Load() {
		return // the usual case: no outage, no lock
	}
	p.out.mu.Lock()
	n, since := p.out.fails, p.out.since
	p.out.fails = 0
	p.out.active.Store(false)
	p.out.mu.Unlock()
	if n > 0 {
		p.log.Info("justonce consumer: database available again",
			"scope", p.cfg.Scope, "down_for", time.Since(since).Round(time.Millisecond), "failed_attempts", n)
	}
}

var errInFlight = errors.New("justonce/consumer: event in flight elsewhere")

func (p *Processor) retry(m *Message, d Decision) Decision {
	d.Action = Retry
	d.at = time.Now()
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
	if keyed && errors.Is(cause, inbox.ErrCommitUnknown) {
		// The last attempt's commit may have gone through: if it did, the
		// message is done, not failed.
		var rec *inbox.Record
		err := p.untilDone(ctx, m, "checking a commit whose answer was lost", func() error {
			r, err := p.cfg.Ledger.Lookup(ctx, p.request(m).Key)
			if errors.Is(err, inbox.ErrNotFound) {
				return nil
			}
			rec = r
			return err
		})
		if err != nil {
			return Decision{Action: Stop, Err: fmt.Errorf("look up: %w (cause: %w)", err, cause)}
		}
		if rec != nil && rec.Status == inbox.StatusDone {
			out := inbox.Outcome{Disposition: inbox.Duplicate, Record: rec, Result: rec.Result}
			p.outcome(m, out, 0)
			return Decision{Action: Ack, Outcome: out, HandlerRan: true}
		}
	}
	if p.cfg.DeadLetter != nil {
		// The decision is made: only the publish is retried, in place and
		// with a growing backoff, never the handler.
		err := p.untilDone(ctx, m, "publishing a dead letter", func() error { return p.cfg.DeadLetter(ctx, m, cause) })
		if err != nil {
			// The context ended: the message comes again and is decided anew.
			return Decision{Action: Stop, Err: fmt.Errorf("dead letter: %w (cause: %w)", err, cause)}
		}
	} else {
		p.log.ErrorContext(ctx, "justonce consumer: message failed for good", "id", inbox.Mask(m.ID), "topic", m.Topic, "attempts", m.Attempt, "err", cause)
	}
	if keyed {
		err := p.untilDone(ctx, m, "recording a failure", func() error {
			_, err := p.cfg.Ledger.RecordFailure(ctx, p.request(m), m.Attempt, cause)
			if errors.Is(err, inbox.ErrCacheStale) {
				// Recorded; only the Redis cache may answer stale until
				// its entry expires. Nothing to retry.
				p.log.WarnContext(ctx, "justonce consumer: failure recorded, Redis cache not invalidated", "id", inbox.Mask(m.ID), "err", err)
				return nil
			}
			if err != nil && !inbox.IsTransient(err) {
				// Published but not recordable: a redelivery is
				// dead-lettered again (dead letters are at-least-once).
				p.log.ErrorContext(ctx, "justonce consumer: dead-lettered but not recorded failed", "id", inbox.Mask(m.ID), "err", err)
				return nil
			}
			return err
		})
		if err != nil {
			return Decision{Action: Stop, Err: fmt.Errorf("record failure: %w (cause: %w)", err, cause)}
		}
	}
	if p.cfg.Hooks.OnDeadLetter != nil {
		p.cfg.Hooks.OnDeadLetter(m, cause)
	}
	return Decision{Action: Ack, DeadLettered: true, Err: cause}
}

// untilDone runs step until it returns nil, waiting StoreBackoff between
// tries (growing, up to its Max), with one warning for the first failure
// and one line when it succeeds after failing. It returns the last error
// only when ctx ends first.
func (p *Processor) untilDone(ctx context.Context, m *Message, what string, step func() error) error {
	for n := 1; ; n++ {
		err := step()
		if err == nil {
			if n > 1 {
				p.log.InfoContext(ctx, "justonce consumer: "+what+" succeeded after retries", "id", inbox.Mask(m.ID), "tries", n)
			}
			return nil
		}
		if ctx.Err() != nil {
			return err
		}
		if n == 1 {
			p.log.WarnContext(ctx, "justonce consumer: "+what+" failed, retrying", "id", inbox.Mask(m.ID), "err", err)
		}
		if p.cfg.Hooks.OnRetry != nil {
			p.cfg.Hooks.OnRetry(m, err)
		}
		if Sleep(ctx, p.cfg.StoreBackoff.Delay(n)) != nil {
			return err
		}
	}
}

// runUndeduped runs a message that has no ID in a plain transaction.
func (p *Processor) runUndeduped(ctx context.Context, m *Message) Decision {
	var err error
	ran := false
	func() {
		defer recovered(&err)
		err = pgx.BeginFunc(ctx, p.cfg.Ledger.Pool(), func(tx pgx.Tx) error {
			ran = true
			_, err := p.call(ctx, tx, m)
			return err
		})
	}()
	if err != nil && !ran {
		// The handler never ran: the connection or BEGIN failed.
		err = &inbox.StoreError{Op: "begin", Err: err}
	}
	return p.decide(ctx, m, inbox.Outcome{Disposition: inbox.Executed}, err, 0, ran)
}

// ProcessWithRetry processes m until it is done: it makes an attempt
// (Process) and carries on with Retry. It returns the final Decision, Ack
// or Stop.
func (p *Processor) ProcessWithRetry(ctx context.Context, m *Message, wait func(ctx context.Context, d time.Duration) error) Decision {
	return p.Retry(ctx, m, p.Process(ctx, m), wait)
}

// Retry carries on after d, a Decision that Process or ProcessBatch made
// for m: while the Decision is Retry it adds one to m.Attempt if the
// failure counted (Decision.Counted), waits the Decision's delay (counted
// from when it was made) and makes another attempt on ctx. It returns the
// final Decision, Ack or Stop. Retries that do not count (the database
// unreachable, a race lost, a key in flight elsewhere) leave m.Attempt
// alone; those after the handler ran are bounded by Config.MaxUncounted.
//
// This is the one retry loop of every front. wait is how it waits between
// attempts; nil sleeps on ctx (Sleep). A front passes its own to do
// something while a message waits (give a worker slot back, keep the
// message in progress) or to stop waiting when it shuts down without
// cancelling ctx, which an attempt already running still uses. When wait
// returns an error, Retry returns Stop with that error (wrap the context's
// error in it): the message is neither acked nor retried here.
func (p *Processor) Retry(ctx context.Context, m *Message, d Decision, wait func(ctx context.Context, d time.Duration) error) Decision {
	if wait == nil {
		wait = Sleep
	}
	for d.Action == Retry {
		if d.Counted {
			m.Attempt++
		}
		if err := wait(ctx, d.Delay-time.Since(d.at)); err != nil {
			return Decision{Action: Stop, Err: fmt.Errorf("%w (last attempt: %w)", err, d.Err)}
		}
		d = p.Process(ctx, m)
	}
	return d
}

// Sleep waits d, or until ctx ends: then it returns ctx's error. It is
// Retry's wait when none is given.
func Sleep(ctx context.Context, d time.Duration) error { return backoff.Sleep(ctx, d) }
