package inbox

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/backoff"
)

// Steps: recovery points for work that spans Postgres and outside
// services. DoSteps claims a key in lease mode; the handler is split into
// named steps, each recorded in processed_steps once its effect happened
// (a Postgres step in the same transaction as its writes); a later attempt
// of the key (after an error, a crash, a lost lease, in another process)
// skips every recorded step and gets its recorded output. Every record is
// fenced by the lease's token, so a holder that lost its lease records
// nothing.

// StepKind says what a recorded step is.
type StepKind string

// Step kinds.
const (
	// StepTx is a Postgres step (Steps.Tx): its writes and its record
	// committed in one transaction. Exactly once.
	StepTx StepKind = "tx"
	// StepCall is an outside step (Steps.Call): its output was recorded
	// after the call returned. At least once, deduplicated downstream by
	// the step's key.
	StepCall StepKind = "call"
	// StepCompensate is the compensation of an earlier step (declared with
	// Steps.Compensate), run after a permanent failure. It is named
	// "compensate:" and the compensated step's name.
	StepCompensate StepKind = "compensate"
	// StepFailed is the permanent failure that started the key's
	// compensations, named after the step that failed ("" when the handler
	// failed outside a step); its Output is the error's text. While it is
	// recorded the key runs no new step: a later attempt resumes the
	// compensations.
	StepFailed StepKind = "failed"
)

// CompensatePrefix begins the name of a compensation step: the compensation
// of step "charge" is recorded as step "compensate:charge". Handlers may
// not give their steps names that begin with it.
const CompensatePrefix = "compensate:"

// Step is one recorded step of a key (Ledger.Steps).
type Step struct {
	// Name is the step's name (for a compensation, CompensatePrefix and the
	// compensated step's name).
	Name string
	Kind StepKind
	// Seq orders the key's steps: 1, 2, ... in the order they were
	// recorded.
	Seq int
	// Output is what the step returned (a compensation records none; a
	// failure its error's text).
	Output []byte
	// Token is the fencing token of the lease that recorded the step.
	Token       int64
	CompletedAt time.Time
}

// StepsFunc is a handler made of steps, run by DoSteps. It runs again on
// every attempt of its key, and must take the same steps, by the same
// names, in the same order, whenever the recorded outputs are the same:
// recorded steps are skipped on a later attempt, which gets their
// outputs instead.
type StepsFunc func(ctx context.Context, s *Steps) (Result, error)

// StepKey returns the key of step of the request key k: the unpadded
// base64url encoding of the first 24 bytes of the SHA-256 of the
// length-prefixed parts ("justonce.step", scope, tenant, ID, step), 32
// characters of A-Z, a-z, 0-9, - and _. It is the same in every process
// and on every attempt, and differs between steps, keys, tenants and
// scopes: pass it to the outside service as its idempotency key
// (Steps.Call gives it to the call), so that the service deduplicates a
// call repeated after a crash. The compensation of step "charge" has the
// key StepKey(k, "compensate:charge").
func StepKey(k Key, step string) string {
	h := sha256.New()
	var n [8]byte
	for _, p := range [...]string{"justonce.step", k.Scope, k.Tenant, k.ID, step} {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write([]byte(p))
	}
	return base64.RawURLEncoding.EncodeToString(h.Sum(nil)[:24])
}

// Steps runs the steps of one attempt of a key (DoSteps). Run steps one
// at a time, from the handler; a step may not run inside another.
type Steps struct {
	l     *Ledger
	lease *Lease
	req   Request
	lost  <-chan struct{}

	running  atomic.Bool
	recorded map[string]Step // the key's recorded steps, by name
	seq      int             // the highest recorded Seq
	undo     map[string]func(ctx context.Context, key string, output []byte) error
	failure  *Step  // the recorded permanent failure, if any
	failedAt string // the step whose function returned a permanent error
	// touched: the key may have recorded steps (some were loaded, a
	// record was tried, or loading failed), so that giving the lease up
	// keeps its row.
	touched bool
	lostErr error // the lease was found lost
}

// DoSteps claims req.Key in lease mode with a lease of d
// (Config.LeaseDuration when 0), like DoLeased, loads the key's recorded
// steps, and runs fn with a *Steps, renewing the lease while fn runs (fn's
// context is cancelled if the lease is lost, and carries the *Steps:
// StepsFrom). When fn returns nil its
// Result is recorded (Executed) and replayed to later duplicates, as by
// DoLeased: Duplicate with Outcome.Result. A key another caller holds is
// InFlight; a known key with another fingerprint is a Mismatch.
//
// When fn returns an error the steps recorded so far stay, and the error
// is returned: the lease ends at once (the key stays processing, under a
// lease that ran out) and the next attempt takes the key over and resumes
// after the recorded steps. When no step was recorded the key is given up
// as by DoLeased (its row deleted). A crash leaves the lease to run out,
// with the same effect. The key's steps expire with it, and Release
// deletes them.
//
// When fn returns an error marked with Permanent (errors.Is ErrPermanent),
// the failure is recorded, the compensations declared with
// Steps.Compensate run for the completed steps in the reverse order of
// their completion, each recorded as a step, and the key is recorded
// failed (Lease.Fail: later duplicates get a Duplicate whose Record has
// Status failed); DoSteps returns fn's error (on an attempt that finished
// the compensations of an earlier one, the recorded failure, marked
// permanent). A compensation that fails
// with an error that is not permanent leaves the key to be retried: the
// next attempt runs no new step (each returns the recorded failure), so
// fn returns, and the compensations not yet recorded run. A compensation
// that fails permanently ends them: the key is recorded failed with both
// errors, and the compensations after it do not run.
//
// A panic in fn is treated as a retryable error, then re-raised.
func (l *Ledger) DoSteps(ctx context.Context, req Request, d time.Duration, fn StepsFunc) (Outcome, error) {
	lease, hasSteps, out, err := l.acquireLease(ctx, req, d, true)
	if err != nil || lease == nil {
		return out, err
	}
	s := &Steps{l: l, lease: lease, req: req}
	return lease.run(ctx, func(ctx context.Context, lost <-chan struct{}) (Result, error) {
		s.lost = lost
		if err := s.load(ctx, hasSteps); err != nil {
			return Result{}, err
		}
		res, err := fn(context.WithValue(ctx, stepsCtxKey{}, s), s)
		return s.finish(ctx, res, err)
	}, s.giveUp)
}

type stepsCtxKey struct{}

// StepsFrom returns the *Steps of the DoSteps attempt whose handler runs
// with ctx (DoSteps gives its fn a context that carries them), or nil
// outside one. It is how a handler run by a front reaches its steps: the
// consumer fronts (consumer.Steps), the HTTP bridge (httpbridge.Steps)
// and the gRPC bridge (grpcbridge.Steps) return it.
func StepsFrom(ctx context.Context) *Steps {
	s, _ := ctx.Value(stepsCtxKey{}).(*Steps)
	return s
}

// Key returns the key the steps run for.
func (s *Steps) Key() Key { return s.req.Key }

// Token returns the lease's fencing token (see Lease.Token).
func (s *Steps) Token() int64 { return s.lease.Token() }

// Tx runs step name, a Postgres step: fn's writes through tx and the
// step's record commit in one transaction, fenced by the lease's token, so
// the step happens exactly once (as with Do). fn returns the step's
// output. When the step is recorded already, fn does not run and Tx
// returns the recorded output. The transaction begins with fn's first
// statement (BEGIN is sent in its round trip; a statement without
// arguments sends it alone first) and the record travels with COMMIT, so
// the step adds no round trip to fn's own.
//
// fn must not commit or roll back tx (ErrTxOwned); it may open nested
// transactions (savepoints) with tx.Begin. When fn returns an error or
// panics, the transaction rolls back and nothing is recorded. When the
// lease was lost (the key taken over by another holder) the transaction
// rolls back, nothing is recorded, and Tx returns an error matching
// ErrLeaseLost. A commit whose outcome is unknown (ErrCommitUnknown) is
// found out by the next attempt: the step is recorded, or not at all.
//
// Inside fn, EventKey returns the step's own key (the request's scope and
// tenant, and StepKey as its ID), with Sequence starting at 0 on every
// run: an outbox message fn adds gets an ID of the step's own, the same
// on every attempt.
func (s *Steps) Tx(ctx context.Context, name string, fn func(ctx context.Context, tx pgx.Tx) ([]byte, error)) ([]byte, error) {
	out, done, err := s.begin(name, StepTx)
	if done || err != nil {
		return out, err
	}
	defer s.running.Store(false)
	l := s.l
	pc, err := l.pool.Acquire(ctx)
	if err != nil {
		return nil, s.ctxErr(storeErr("acquire", err))
	}
	var failed error
	defer func() { releaseConn(pc, failed) }()
	conn := pc.Conn()
	tx := &stepTx{ownedTx: ownedTx{conn: conn}} // begun by fn's first statement
	hctx, run := withEventAtCommit(ctx, s.stepEvent(name))
	if _, failed = runHandlerTx(hctx, conn, tx, func(ctx context.Context, tx pgx.Tx) (Result, error) {
		var err error
		out, err = fn(ctx, tx)
		return Result{}, err
	}); failed != nil {
		return nil, s.stepFailed(name, failed)
	}
	p := s.params(name, StepTx, out)
	failed = l.commit(ctx, conn, func(b *pgx.Batch) {
		if !tx.begun() { // fn sent nothing
			b.Queue(sqlBegin)
		}
		run.flush(b)
		l.store.rows.queueRecordStep(b, p)
	})
	if isStepFenced(failed) {
		return nil, s.leaseLost("record step "+name, failed)
	}
	if failed != nil {
		return nil, failed
	}
	s.add(p)
	l.stats.stepsTx.Add(1)
	return out, nil
}

// Call runs step name, whose effect is outside the database: fn gets the
// step's key, StepKey(s.Key(), name), to pass to the outside service as
// its idempotency key, and returns the step's output, which Call records,
// fenced by the lease's token, before it returns. When the step is
// recorded already, fn does not run and Call returns the recorded output.
//
// The step happens at least once: a crash (or an error) after fn returned
// and before its record committed runs fn again on the next attempt, with
// the same key, so the service must deduplicate on it (as payment
// providers do with their idempotency keys) and answer a repeat with the
// first call's result. A transient failure to record is retried while the
// lease is held, for up to one lease duration. When the lease was lost,
// the record is refused and Call returns an error matching ErrLeaseLost;
// fn's effect may have happened, and the key's new holder calls again
// with the same key.
//
// Inside fn, EventKey returns the step's own key, as in Tx.
func (s *Steps) Call(ctx context.Context, name string, fn func(ctx context.Context, key string) ([]byte, error)) ([]byte, error) {
	out, done, err := s.begin(name, StepCall)
	if done || err != nil {
		return out, err
	}
	defer s.running.Store(false)
	out, err = fn(WithEvent(ctx, s.stepEvent(name)), StepKey(s.req.Key, name))
	if err != nil {
		return nil, s.stepFailed(name, err)
	}
	if err := s.record(ctx, s.params(name, StepCall, out)); err != nil {
		return nil, err
	}
	s.l.stats.stepsCall.Add(1)
	return out, nil
}

// Compensate declares how to undo step name once it completed, should the
// key fail permanently later (see DoSteps): fn gets the compensation's key,
// StepKey(s.Key(), "compensate:"+name), to pass to the outside service,
// and the step's recorded output. The compensation is itself a step,
// recorded as "compensate:"+name, so it runs at least once, like a Call,
// and is deduplicated by its key: write fn to be repeatable (a refund
// with the key; a statement that cancels an order). Declare it on every
// attempt, before or after the step runs (a step completed and skipped
// needs its compensation too): a later declaration for the same name
// replaces an earlier one. Completed steps without a compensation are
// left as they are.
func (s *Steps) Compensate(name string, fn func(ctx context.Context, key string, output []byte) error) {
	if s.undo == nil {
		s.undo = map[string]func(context.Context, string, []byte) error{}
	}
	s.undo[name] = fn
}

// load reads the key's recorded steps, once the key is claimed, when it
// has some (the claim said: a key without any needs no round trip).
func (s *Steps) load(ctx context.Context, hasSteps bool) error {
	if !hasSteps {
		s.recorded = map[string]Step{}
		return nil
	}
	steps, err := s.l.store.rows.loadSteps(ctx, s.l.pool, s.req.Key, s.lease.token)
	if err != nil {
		s.touched = true // unknown: the steps, if any, must stay
		return storeErr("load steps", err)
	}
	s.recorded = make(map[string]Step, len(steps))
	for _, st := range steps {
		s.recorded[st.Name] = st
		s.seq = max(s.seq, st.Seq)
		if st.Kind == StepFailed {
			s.failure = &st
		}
	}
	s.touched = len(steps) > 0
	return nil
}

// begin checks step name before it runs: done when it is recorded (out is
// its output), an error when it may not run. Otherwise the step is
// running until the caller stores false in s.running.
func (s *Steps) begin(name string, kind StepKind) (out []byte, done bool, err error) {
	if err := s.checkName(name); err != nil {
		return nil, false, err
	}
	if st, ok := s.recorded[name]; ok && st.Kind != StepFailed {
		if st.Kind != kind {
			return nil, false, &KeyError{Field: "step", Reason: fmt.Sprintf("%q was recorded as a %s step, not a %s step", name, st.Kind, kind)}
		}
		s.l.stats.stepsResumed.Add(1)
		return st.Output, true, nil
	}
	if s.failure != nil {
		return nil, false, s.failureErr(name)
	}
	if s.lostErr != nil {
		return nil, false, s.lostErr
	}
	select {
	case <-s.lost:
		return nil, false, s.leaseLost("step "+name, nil)
	default:
	}
	if !s.running.CompareAndSwap(false, true) {
		return nil, false, fmt.Errorf("justonce/inbox: step %q: steps run one at a time, and not inside one another", name)
	}
	return nil, false, nil
}

// checkName refuses a step name that is empty, too long, not UTF-8, has a
// NUL byte, or begins with CompensatePrefix.
func (s *Steps) checkName(name string) error {
	if err := checkPart("step", name, s.l.cfg.MaxKeyLen, false); err != nil {
		return err
	}
	if strings.HasPrefix(name, CompensatePrefix) {
		return &KeyError{Field: "step", Reason: "begins with " + CompensatePrefix + ", which compensations use"}
	}
	return nil
}

// stepEvent is the key EventKey returns inside step name.
func (s *Steps) stepEvent(name string) Key {
	k := s.req.Key
	return Key{Scope: k.Scope, Tenant: k.Tenant, ID: StepKey(k, name)}
}

// params describes the record of step name as the key's next step.
func (s *Steps) params(name string, kind StepKind, out []byte) stepParams {
	s.touched = true
	return stepParams{key: s.req.Key, name: name, kind: kind, seq: s.seq + 1, output: out, token: s.lease.token}
}

// add notes a step recorded.
func (s *Steps) add(p stepParams) {
	st := Step{Name: p.name, Kind: p.kind, Seq: p.seq, Output: p.output, Token: p.token, CompletedAt: time.Now()}
	s.recorded[p.name] = st
	s.seq = p.seq
	if p.kind == StepFailed {
		s.failure = &st
	}
}

// record records a step whose effect happened outside the database,
// retrying a transient failure while the lease is held, for up to one
// lease duration, whatever ctx says: the effect has happened.
func (s *Steps) record(ctx context.Context, p stepParams) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.lease.dur)
	defer cancel()
	rows := s.l.store.rows
	for n := 1; ; n++ {
		err := rows.recordStep(ctx, s.l.pool, p)
		switch {
		case err == nil:
			s.add(p)
			return nil
		case isStepFenced(err):
			return s.leaseLost("record step "+p.name, err)
		case isStepConflict(err):
			// An earlier try committed and only its answer was lost, or
			// (the lease lost) another holder recorded the step.
			steps, lerr := rows.steps(ctx, s.l.pool, p.key)
			for _, st := range steps {
				if st.Name == p.name && st.Token == p.token {
					s.add(p)
					return nil
				}
			}
			if lerr != nil {
				return storeErr("record step", lerr)
			}
			return s.leaseLost("record step "+p.name, err)
		}
		err = storeErr("record step", err)
		if !IsTransient(err) || ctx.Err() != nil {
			return err
		}
		s.l.cfg.Logger.WarnContext(ctx, "justonce/inbox: recording a step failed, will retry",
			"key", p.key.String(), "step", p.name, "err", err)
		t := time.NewTimer(backoff.Backoff{Initial: 20 * time.Millisecond, Max: time.Second, Multiplier: 2}.Delay(n))
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-s.lost:
			t.Stop()
			return s.leaseLost("record step "+p.name, err)
		case <-t.C:
		}
	}
}

// leaseLost is the error of a step refused because the lease was lost
// (cause, if any, says how it was found out), and counts the loss once.
func (s *Steps) leaseLost(what string, cause error) error {
	if s.lostErr != nil {
		return s.lostErr
	}
	s.l.stats.leasesLost.Add(1)
	msg := fmt.Sprintf("%s %s (token %d)", what, s.req.Key, s.lease.token)
	if cause != nil {
		msg += ": " + trimPrefix(cause)
	}
	s.lostErr = fmt.Errorf("%w: %s", ErrLeaseLost, msg)
	return s.lostErr
}

// ctxErr is err, or the lease's loss when that is why ctx ended.
func (s *Steps) ctxErr(err error) error {
	select {
	case <-s.lost:
		return s.leaseLost("step", err)
	default:
		return err
	}
}

// stepFailed notes the step whose function returned err, when err is
// permanent, and returns err (the lease's loss when ctx ended for it).
func (s *Steps) stepFailed(name string, err error) error {
	if errors.Is(err, ErrPermanent) && s.failedAt == "" {
		s.failedAt = name
	}
	if errors.Is(err, context.Canceled) {
		return s.ctxErr(err)
	}
	return err
}

// failureErr is what a step returns while the key's permanent failure is
// recorded: the failure, permanent.
func (s *Steps) failureErr(name string) error {
	return Permanent(fmt.Errorf("justonce/inbox: step %q not run: the key failed permanently (at %q): %s",
		name, s.failure.Name, s.failure.Output))
}

// finish ends an attempt whose handler returned res and err: a permanent
// failure (or one recorded before) is compensated and recorded.
func (s *Steps) finish(ctx context.Context, res Result, err error) (Result, error) {
	if s.failure == nil && (err == nil || !errors.Is(err, ErrPermanent)) {
		return res, err
	}
	if s.lostErr != nil {
		return Result{}, s.lostErr
	}
	cause := err
	if s.failure == nil {
		p := s.params(s.failedAt, StepFailed, []byte(err.Error()))
		if rerr := s.record(ctx, p); rerr != nil {
			return Result{}, fmt.Errorf("justonce/inbox: recording a permanent failure (%v): %w", err, rerr)
		}
	} else {
		cause = Permanent(errors.New(string(s.failure.Output)))
	}
	if cerr := s.compensate(ctx); cerr != nil {
		if !errors.Is(cerr, ErrPermanent) {
			return Result{}, fmt.Errorf("justonce/inbox: compensating after a permanent failure (%v): %w", cause, cerr)
		}
		cause = Permanent(fmt.Errorf("%w (compensating after: %v)", cerr, cause))
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.lease.dur)
	defer cancel()
	if ferr := s.lease.Fail(fctx, cause); ferr != nil {
		return Result{}, fmt.Errorf("justonce/inbox: recording a permanent failure (%v): %w", cause, ferr)
	}
	return Result{}, cause
}

// compensate runs the declared compensations of the completed steps not
// compensated yet, in the reverse order of their completion, recording
// each.
func (s *Steps) compensate(ctx context.Context) error {
	done := make([]Step, 0, len(s.recorded))
	for _, st := range s.recorded {
		if st.Kind == StepTx || st.Kind == StepCall {
			done = append(done, st)
		}
	}
	sort.Slice(done, func(i, j int) bool { return done[i].Seq > done[j].Seq })
	for _, st := range done {
		fn, name := s.undo[st.Name], CompensatePrefix+st.Name
		if _, ok := s.recorded[name]; ok || fn == nil {
			if ok {
				s.l.stats.stepsResumed.Add(1)
			}
			continue
		}
		if err := fn(WithEvent(ctx, s.stepEvent(name)), StepKey(s.req.Key, name), st.Output); err != nil {
			return fmt.Errorf("%s: %w", name, s.ctxErr(err))
		}
		if err := s.record(ctx, s.params(name, StepCompensate, nil)); err != nil {
			return err
		}
		s.l.stats.stepsCompensate.Add(1)
	}
	return nil
}

// giveUp ends the lease of an attempt that failed: the key's row is kept
// (its lease run out) when it may have recorded steps, deleted otherwise.
func (s *Steps) giveUp(ctx context.Context) error {
	if s.lostErr != nil {
		return nil
	}
	if !s.touched {
		return s.lease.Abandon(ctx)
	}
	return s.lease.lapse(ctx)
}

// Steps returns the live recorded steps of k (DoSteps), in the order they
// were recorded: none when k has none, or its row expired.
func (l *Ledger) Steps(ctx context.Context, k Key) ([]Step, error) {
	if err := k.Validate(l.cfg.MaxKeyLen); err != nil {
		return nil, err
	}
	steps, err := l.store.rows.steps(ctx, l.pool, k)
	return steps, storeErr("steps", err)
}
