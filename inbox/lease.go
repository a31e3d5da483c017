package inbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/justonce/justonce/backoff"
)

// Lease is a key claimed in lease mode, for effects outside the database
// (calling a payment provider): the claim commits at once with status
// processing, the work runs, and Complete records the result in a second
// transaction. While the lease runs, other callers get InFlight; when it
// expires (the holder crashed) the next caller takes the key over with a
// larger fencing token, and the work runs again. Pass Token to downstream
// systems so they can reject a stale holder's writes.
type Lease struct {
	l     *Ledger
	s     ledgerStore
	req   Request
	token int64
	dur   time.Duration
	start time.Time

	mu   sync.Mutex
	done bool
}

// LeaseFunc is work run under a lease; token is the lease's fencing token.
type LeaseFunc func(ctx context.Context, token int64) (Result, error)

// AcquireLease claims req.Key with a lease of d (Config.LeaseDuration when 0).
// When the key is claimed it returns a *Lease and an Outcome with no
// Disposition; otherwise a nil Lease and the Outcome (Duplicate, InFlight,
// Mismatch), waiting up to the lock wait while the key is held.
func (l *Ledger) AcquireLease(ctx context.Context, req Request, d time.Duration) (*Lease, Outcome, error) {
	lease, _, out, err := l.acquireLease(ctx, req, d, false)
	return lease, out, err
}

// acquireLease is AcquireLease; with steps (DoSteps) the claim's round
// trip also asks whether the key has recorded steps (hasSteps).
func (l *Ledger) acquireLease(ctx context.Context, req Request, d time.Duration, steps bool) (lease *Lease, hasSteps bool, out Outcome, err error) {
	if err := l.Validate(req); err != nil {
		return nil, false, Outcome{}, err
	}
	if d <= 0 {
		d = l.cfg.LeaseDuration
	}
	out, err = l.withWait(ctx, req, func() (Outcome, error) {
		q, release, err := l.leaseQuerier(ctx, req)
		if err != nil {
			return Outcome{}, err
		}
		s, err := l.store.get(ctx, q)
		var cr claimRow
		if err == nil {
			p := claimParams{req: req, ttl: l.ttl(req), lease: d, owner: l.cfg.Owner}
			if steps {
				cr, hasSteps, err = s.claimLeaseSteps(ctx, q, p)
			} else {
				cr, err = s.claimLease(ctx, q, p)
			}
		}
		release(err)
		if err != nil {
			return Outcome{}, storeErr("claim", err)
		}
		if cr.claimed {
			lease = &Lease{l: l, s: s, req: req, token: cr.rec.FencingToken, dur: d, start: time.Now()}
			return Outcome{}, nil
		}
		return classify(req, cr), nil
	})
	return lease, hasSteps, out, err
}

// Key returns the leased key.
func (ls *Lease) Key() Key { return ls.req.Key }

// Token returns the fencing token: it only grows, across takeovers and
// across keys.
func (ls *Lease) Token() int64 { return ls.token }

// Renew extends the lease by its duration from now. ErrLeaseLost when the
// key was taken over, released or completed.
func (ls *Lease) Renew(ctx context.Context) error {
	ok, err := ls.s.renew(ctx, ls.l.pool, leaseParams{key: ls.req.Key, token: ls.token, lease: ls.dur})
	return ls.check(ok, err, "renew")
}

// Complete records res and marks the key done. ErrLeaseLost when the lease
// was lost: then another holder may have run too, which is what the fencing
// token is for.
//
// Any failure but ErrLeaseLost leaves the lease unfinished, so that the
// caller may call Complete again (CompleteRetrying does so for transient
// failures while the lease is held), or Fail or Abandon it.
func (ls *Lease) Complete(ctx context.Context, res Result) error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.done {
		return fmt.Errorf("%w: lease already finished", ErrLeaseLost)
	}
	ok, err := ls.s.leaseComplete(ctx, ls.l.pool, leaseParams{key: ls.req.Key, token: ls.token, res: res, took: time.Since(ls.start),
		resultTTL: ls.l.resultTTL(ls.req)})
	err = ls.check(ok, err, "complete")
	if err == nil || errors.Is(err, ErrLeaseLost) {
		ls.done = true
	}
	return err
}

// Fail marks the key failed with cause: later callers get a Duplicate whose
// Record has Status failed, until the key is released or expires.
func (ls *Lease) Fail(ctx context.Context, cause error) error {
	if err := ls.finish(); err != nil {
		return err
	}
	msg := ""
	if cause != nil {
		msg = cause.Error()
	}
	ok, err := ls.s.leaseFail(ctx, ls.l.pool, leaseParams{key: ls.req.Key, token: ls.token, errText: msg, took: time.Since(ls.start)})
	return ls.check(ok, err, "fail")
}

// Abandon gives the key up without a result, so that the next caller runs
// the work again.
func (ls *Lease) Abandon(ctx context.Context) error {
	if err := ls.finish(); err != nil {
		return err
	}
	ok, err := ls.s.leaseAbandon(ctx, ls.l.pool, leaseParams{key: ls.req.Key, token: ls.token})
	return ls.check(ok, err, "abandon")
}

// lapse ends the lease now without deleting the key's row (Abandon
// deletes it): the row stays processing under a lease that ran out, so the
// key keeps its fingerprint and its recorded steps, and the next caller
// takes it over at once, with a larger fencing token, and resumes.
func (ls *Lease) lapse(ctx context.Context) error {
	if err := ls.finish(); err != nil {
		return err
	}
	ok, err := ls.s.leaseLapse(ctx, ls.l.pool, leaseParams{key: ls.req.Key, token: ls.token})
	return ls.check(ok, err, "abandon")
}

func (ls *Lease) finish() error {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.done {
		return fmt.Errorf("%w: lease already finished", ErrLeaseLost)
	}
	ls.done = true
	return nil
}

func (ls *Lease) check(ok bool, err error, op string) error {
	if err != nil {
		return storeErr(op, err)
	}
	if !ok {
		ls.l.stats.leasesLost.Add(1)
		return fmt.Errorf("%w: %s %s (token %d)", ErrLeaseLost, op, ls.req.Key, ls.token)
	}
	return nil
}

// KeepAlive renews the lease every third of its duration until stop is
// called. lost is closed if a renewal finds the lease lost.
func (ls *Lease) KeepAlive(ctx context.Context) (lost <-chan struct{}, stop func()) {
	lostCh := make(chan struct{})
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(ls.dur / 3)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if err := ls.Renew(ctx); errors.Is(err, ErrLeaseLost) {
					close(lostCh)
					return
				}
				// A store error is retried at the next tick; the lease
				// still has two thirds of its time.
			}
		}
	}()
	return lostCh, func() { cancel(); wg.Wait() }
}

// DoLeased runs fn once for req.Key under a lease of d (Config.LeaseDuration
// when 0), renewing it while fn runs. fn's context is cancelled if the lease
// is lost. On success the result is recorded (Executed); on error or panic
// the lease is released so a retry runs fn again, and the error is returned.
// A crash leaves the lease to expire; the next caller then runs fn again:
// effects outside the database are at-least-once, made safe by the fencing
// token and by an idempotent downstream. Work of several effects that
// should resume where it stopped, rather than run again whole, is DoSteps'.
func (l *Ledger) DoLeased(ctx context.Context, req Request, d time.Duration, fn LeaseFunc) (Outcome, error) {
	lease, out, err := l.AcquireLease(ctx, req, d)
	if err != nil || lease == nil {
		return out, err
	}
	return lease.run(ctx, func(ctx context.Context, _ <-chan struct{}) (Result, error) {
		return fn(ctx, lease.Token())
	}, lease.Abandon)
}

// run runs work under the lease, renewing it while work runs, and records
// work's result. work's context is cancelled if the lease is lost (lost is
// closed then). On error or panic giveUp is called, with a context of its
// own, and the error returned (a panic goes on).
func (ls *Lease) run(ctx context.Context, work func(ctx context.Context, lost <-chan struct{}) (Result, error),
	giveUp func(context.Context) error) (Outcome, error) {
	l, req := ls.l, ls.req
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	lost, stop := ls.KeepAlive(runCtx)
	go func() {
		select {
		case <-lost:
			cancel()
		case <-runCtx.Done():
		}
	}()
	var res Result
	var err error
	func() {
		ok := false
		defer func() {
			if !ok {
				stop()
				rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				_ = giveUp(rctx)
				rcancel()
			}
		}()
		res, err = work(WithEvent(runCtx, req.Key), lost)
		ok = err == nil
	}()
	if err != nil {
		l.observe(req, Outcome{}, err)
		return Outcome{}, err
	}
	// The effect has happened: record it while the lease is kept alive, and
	// retry a transient failure rather than let the lease lapse, which
	// would run the effect again.
	// The caller's cancellation does not stop it at once, but it gives up
	// one lease duration after the caller's context ended.
	cctx, ccancel := context.WithCancel(context.WithoutCancel(ctx))
	stopAfter := context.AfterFunc(ctx, func() { time.AfterFunc(ls.dur, ccancel) })
	err = ls.CompleteRetrying(cctx, res, lost)
	stopAfter()
	ccancel()
	stop()
	if err != nil {
		l.observe(req, Outcome{}, err)
		return Outcome{}, err
	}
	out := Outcome{Disposition: Executed, Result: res}
	l.observe(req, out, nil)
	return out, nil
}

// CompleteRetrying records res like Complete, and retries a transient
// failure with backoff until it succeeds, fails for good, the lease is lost
// (lost is closed: pass KeepAlive's channel, and keep the lease alive while
// it runs), or ctx ends. A completion that committed though its answer was
// lost counts as success: the key is done under this lease's fencing token.
// When ctx ends first, the error wraps ctx's error. The effect has happened
// by the time a caller records it, so give ctx a bound of its own rather
// than a request's cancellation.
func (ls *Lease) CompleteRetrying(ctx context.Context, res Result, lost <-chan struct{}) error {
	for n, retried := 1, false; ; n, retried = n+1, true {
		err := ls.Complete(ctx, res)
		if retried && errors.Is(err, ErrLeaseLost) && ls.completedByUs(ctx) {
			// An earlier attempt committed and only its answer was lost.
			return nil
		}
		if err != nil && ctx.Err() != nil {
			return fmt.Errorf("justonce/inbox: gave up recording a lease's completion: %w (last error: %w)", ctx.Err(), err)
		}
		if err == nil || !IsTransient(err) {
			return err
		}
		ls.l.cfg.Logger.WarnContext(ctx, "justonce/inbox: recording a lease-mode result failed, will retry",
			"key", ls.req.Key.String(), "err", err)
		t := time.NewTimer(backoff.Backoff{Initial: 20 * time.Millisecond, Max: time.Second, Multiplier: 2}.Delay(n))
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("justonce/inbox: gave up recording a lease's completion: %w (last error: %w)", ctx.Err(), err)
		case <-lost:
			t.Stop()
			if ls.completedByUs(ctx) {
				return nil
			}
			return fmt.Errorf("%w: while recording its completion (last error: %v)", ErrLeaseLost, err)
		case <-t.C:
		}
	}
}

// completedByUs reports whether the key is done under this lease's
// fencing token: a completion that committed though its answer was lost.
func (ls *Lease) completedByUs(ctx context.Context) bool {
	rec, live, err := ls.s.lookup(ctx, ls.l.pool, ls.req.Key)
	return err == nil && live && rec != nil && rec.Status == StatusDone && rec.FencingToken == ls.token
}
