package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/ledgerkey"
	"github.com/justonce/justonce/migrations"
)

// provider is an outside service that deduplicates on the idempotency key,
// as a payment provider does: a repeated key gets the first call's answer.
type provider struct {
	mu      sync.Mutex
	first   map[string]string // key -> the answer of its first call
	calls   map[string]int    // key -> calls
	order   []string          // keys, in the order of their first call
	refunds map[string]string // refund key -> charge
}

func newProvider() *provider {
	return &provider{first: map[string]string{}, calls: map[string]int{}, refunds: map[string]string{}}
}

func (p *provider) charge(key, who string) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls[key]++
	if _, ok := p.first[key]; !ok {
		p.first[key] = fmt.Sprintf("ch_%d_%s", len(p.first)+1, who)
		p.order = append(p.order, key)
	}
	return []byte(p.first[key])
}

func (p *provider) refund(key, charge string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls[key]++
	if _, ok := p.refunds[key]; !ok {
		p.refunds[key] = charge
		p.order = append(p.order, key)
	}
}

func (p *provider) callsOf(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls[key]
}

// payment is a handler of three steps: an order row (Tx), a charge at the
// provider (Call) and a receipt (Call, failing with receiptErr while it is
// set), with the compensations of the first two. ran counts the step
// functions that ran, by step.
type payment struct {
	b          *bundle
	p          *provider
	ran        sync.Map // step -> *atomic.Int64
	receiptErr atomic.Pointer[error]
	refundErr  atomic.Pointer[error]
}

func (pm *payment) count(step string) *atomic.Int64 {
	v, _ := pm.ran.LoadOrStore(step, new(atomic.Int64))
	return v.(*atomic.Int64)
}

func (pm *payment) handler(id string) inbox.StepsFunc {
	return func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		order, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			pm.count("order").Add(1)
			_, err := tx.Exec(ctx, `INSERT INTO step_orders (payment, status) VALUES ($1, 'open')`, id)
			return []byte("order-" + id), err
		})
		if err != nil {
			return inbox.Result{}, err
		}
		s.Compensate("order", func(ctx context.Context, key string, output []byte) error {
			pm.count("compensate:order").Add(1)
			pm.p.refund(key, string(output)) // records the order of compensations
			_, err := pm.b.pg.Pool.Exec(ctx, `UPDATE step_orders SET status = 'cancelled' WHERE payment = $1`, id)
			return err
		})
		s.Compensate("charge", func(ctx context.Context, key string, output []byte) error {
			pm.count("compensate:charge").Add(1)
			if e := pm.refundErr.Load(); e != nil {
				return *e
			}
			pm.p.refund(key, string(output))
			return nil
		})
		charge, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			pm.count("charge").Add(1)
			return pm.p.charge(key, "x"), nil
		})
		if err != nil {
			return inbox.Result{}, err
		}
		_, err = s.Call(ctx, "receipt", func(ctx context.Context, key string) ([]byte, error) {
			pm.count("receipt").Add(1)
			if e := pm.receiptErr.Load(); e != nil {
				return nil, *e
			}
			return []byte("mail-" + id), nil
		})
		if err != nil {
			return inbox.Result{}, err
		}
		return inbox.Result{Code: 201, Body: []byte(string(order) + "/" + string(charge))}, nil
	}
}

func stepsLedger(t *testing.T, mc migrations.Config) (*bundle, *payment) {
	b := setupLayout(t, mc, inbox.Config{})
	b.pg.Exec(t, `CREATE TABLE step_orders (payment text NOT NULL, status text NOT NULL)`)
	return b, &payment{b: b, p: newProvider()}
}

func stepNames(steps []inbox.Step) []string {
	names := make([]string, len(steps))
	for i, st := range steps {
		names[i] = fmt.Sprintf("%d %s %s", st.Seq, st.Name, st.Kind)
	}
	return names
}

// A retryable error keeps the recorded steps; the next attempt takes the
// key over at once and resumes after them: the order and the charge run
// once, the receipt until it succeeds; duplicates then get the result.
func TestStepsResumeAfterARetryableError(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b, pm := stepsLedger(t, mc)
		ctx := context.Background()
		r := req("payments", "pay-1")
		r.Fingerprint = []byte("fp")
		down := errors.New("mailer down")
		pm.receiptErr.Store(&down)
		before := b.ledger.Counters()

		_, err := b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-1"))
		require.ErrorIs(t, err, down)
		steps, err := b.ledger.Steps(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, []string{"1 order tx", "2 charge call"}, stepNames(steps))
		require.Equal(t, "order-pay-1", string(steps[0].Output))
		first := steps[0].Token
		rec, err := b.ledger.Lookup(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, inbox.StatusProcessing, rec.Status, "the key is kept, its lease ended")
		require.False(t, rec.LeaseUntil.After(time.Now()))

		// Another request with the key is a mismatch, not a resumption.
		other := r
		other.Fingerprint = []byte("other")
		out, err := b.ledger.DoSteps(ctx, other, 0, pm.handler("pay-1"))
		require.NoError(t, err)
		require.Equal(t, inbox.Mismatch, out.Disposition)

		pm.receiptErr.Store(nil)
		out, err = b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-1"))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
		require.Equal(t, "order-pay-1/ch_1_x", string(out.Result.Body))
		for step, n := range map[string]int64{"order": 1, "charge": 1, "receipt": 2} {
			require.Equal(t, n, pm.count(step).Load(), step)
		}
		steps, err = b.ledger.Steps(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, []string{"1 order tx", "2 charge call", "3 receipt call"}, stepNames(steps))
		require.Equal(t, first, steps[1].Token)
		require.Greater(t, steps[2].Token, first, "the receipt was recorded by the second lease")
		after := b.ledger.Counters()
		require.EqualValues(t, 2, after.StepsResumed-before.StepsResumed)
		require.EqualValues(t, 1, after.StepsTx-before.StepsTx)
		require.EqualValues(t, 2, after.StepsCall-before.StepsCall)

		out, err = b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-1"))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.Equal(t, "order-pay-1/ch_1_x", string(out.Result.Body))
		require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM step_orders WHERE payment = 'pay-1'`))
		require.Equal(t, 1, pm.p.callsOf(inbox.StepKey(r.Key, "charge")))

		// A handler that fails before recording a step gives the key up,
		// as DoLeased does.
		r2 := req("payments", "pay-2")
		_, err = b.ledger.DoSteps(ctx, r2, 0, func(context.Context, *inbox.Steps) (inbox.Result, error) {
			return inbox.Result{}, errors.New("bad input")
		})
		require.Error(t, err)
		_, err = b.ledger.Lookup(ctx, r2.Key)
		require.ErrorIs(t, err, inbox.ErrNotFound)
	})
}

// A permanent failure records the failure, runs the declared compensations
// in reverse order (each recorded), and records the key failed. A
// compensation that fails for the time being is resumed by the next
// attempt, which runs no new step.
func TestStepsPermanentFailureCompensates(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b, pm := stepsLedger(t, mc)
		ctx := context.Background()
		declined := inbox.Permanent(errors.New("address refused"))
		pm.receiptErr.Store(&declined)
		r := req("payments", "pay-p")

		_, err := b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-p"))
		require.ErrorIs(t, err, inbox.ErrPermanent)
		require.ErrorContains(t, err, "address refused")
		steps, err := b.ledger.Steps(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, []string{"1 order tx", "2 charge call", "3 receipt failed",
			"4 compensate:charge compensate", "5 compensate:order compensate"}, stepNames(steps))
		require.Equal(t, "address refused", string(steps[2].Output))
		require.Equal(t, []string{inbox.StepKey(r.Key, "charge"), inbox.StepKey(r.Key, "compensate:charge"),
			inbox.StepKey(r.Key, "compensate:order")}, pm.p.order, "charged, then refunded, then the order cancelled")
		require.Equal(t, 1, b.pg.Count(t, `SELECT count(*) FROM step_orders WHERE payment = 'pay-p' AND status = 'cancelled'`))
		out, err := b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-p"))
		require.NoError(t, err)
		require.Equal(t, inbox.Duplicate, out.Disposition)
		require.Equal(t, inbox.StatusFailed, out.Record.Status)
		require.Contains(t, out.Record.Error, "address refused")

		// The refund fails for now: the next attempt runs no new step
		// (the receipt does not run again) and finishes compensating.
		r = req("payments", "pay-q")
		down := errors.New("provider down")
		pm.refundErr.Store(&down)
		receipts := pm.count("receipt").Load()
		_, err = b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-q"))
		require.ErrorIs(t, err, down)
		require.NotErrorIs(t, err, inbox.ErrPermanent, "a compensation that failed for now is retried")
		rec, err := b.ledger.Lookup(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, inbox.StatusProcessing, rec.Status)
		pm.refundErr.Store(nil)
		before := b.ledger.Counters()
		var seen error // what the handler's step returned
		_, err = b.ledger.DoSteps(ctx, r, 0, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
			_, err := pm.handler("pay-q")(ctx, s)
			seen = err
			return inbox.Result{}, err
		})
		require.ErrorIs(t, seen, inbox.ErrPermanent, "the step not run returns the recorded failure")
		require.ErrorContains(t, seen, `step "receipt" not run`)
		require.ErrorIs(t, err, inbox.ErrPermanent)
		require.ErrorContains(t, err, "address refused")
		require.Equal(t, receipts+1, pm.count("receipt").Load(), "the receipt ran once")
		steps, err = b.ledger.Steps(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, []string{"1 order tx", "2 charge call", "3 receipt failed",
			"4 compensate:charge compensate", "5 compensate:order compensate"}, stepNames(steps))
		require.EqualValues(t, 2, b.ledger.Counters().StepsResumed-before.StepsResumed, "order and charge skipped")
		rec, err = b.ledger.Lookup(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, inbox.StatusFailed, rec.Status)
	})
}

// Release deletes a key's steps with its row; an expired key's steps are
// not seen by its next life, and the janitor deletes them.
func TestStepsReleaseExpiryAndJanitor(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b, pm := stepsLedger(t, mc)
		ctx := context.Background()
		down := errors.New("mailer down")
		pm.receiptErr.Store(&down)

		r := req("payments", "pay-r")
		_, err := b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-r"))
		require.ErrorIs(t, err, down)
		ok, err := b.ledger.Release(ctx, r.Key)
		require.NoError(t, err)
		require.True(t, ok)
		steps, err := b.ledger.Steps(ctx, r.Key)
		require.NoError(t, err)
		require.Empty(t, steps)
		require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_steps WHERE event_id = 'pay-r'`))
		orders := pm.count("order").Load()
		_, err = b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-r"))
		require.ErrorIs(t, err, down)
		require.Equal(t, orders+1, pm.count("order").Load(), "a released key runs its steps again")

		// ReleaseStuck deletes the steps of a stuck key (its lease ran out).
		ok, err = b.ledger.ReleaseStuck(ctx, r.Key)
		require.NoError(t, err)
		require.True(t, ok)
		require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_steps WHERE event_id = 'pay-r'`))

		// Expiry: the steps go with the key.
		r = req("payments", "pay-e")
		r.TTL = 500 * time.Millisecond
		_, err = b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-e"))
		require.ErrorIs(t, err, down)
		require.Equal(t, 2, b.pg.Count(t, `SELECT count(*) FROM processed_steps WHERE event_id = 'pay-e'`))
		testsvc.Eventually(t, 5*time.Second, func() bool {
			steps, err := b.ledger.Steps(ctx, r.Key)
			require.NoError(t, err)
			return len(steps) == 0
		}, "steps expire with the key")
		orders = pm.count("order").Load()
		r.TTL = 0
		pm.receiptErr.Store(nil)
		out, err := b.ledger.DoSteps(ctx, r, 0, pm.handler("pay-e"))
		require.NoError(t, err)
		require.Equal(t, inbox.Executed, out.Disposition)
		require.Equal(t, orders+1, pm.count("order").Load(), "a key used again after it expired runs every step")
		steps, err = b.ledger.Steps(ctx, r.Key)
		require.NoError(t, err)
		require.Equal(t, []string{"1 order tx", "2 charge call", "3 receipt call"}, stepNames(steps))

		// The janitor deletes expired steps.
		pm.receiptErr.Store(&down)
		for i := range 3 {
			r := req("payments", fmt.Sprintf("pay-j%d", i))
			r.TTL = 300 * time.Millisecond
			_, err := b.ledger.DoSteps(ctx, r, 0, pm.handler(r.ID))
			require.ErrorIs(t, err, down)
		}
		require.Equal(t, 6, b.pg.Count(t, `SELECT count(*) FROM processed_steps WHERE event_id LIKE 'pay-j%'`))
		testsvc.Eventually(t, 10*time.Second, func() bool {
			_, err := b.ledger.Purge(ctx, inbox.JanitorConfig{BatchSize: 2})
			require.NoError(t, err)
			return b.pg.Count(t, `SELECT count(*) FROM processed_steps WHERE event_id LIKE 'pay-j%'`) == 0
		}, "expired steps purged")
		require.Equal(t, 3, b.pg.Count(t, `SELECT count(*) FROM processed_steps WHERE event_id = 'pay-e'`), "live steps stay")
	})
}

// A holder that lost its lease (held up past it, the key taken over with a
// larger token) records no step: its Postgres step's writes roll back and
// its call's record is refused, both with ErrLeaseLost; the new holder's
// steps stand.
func TestStepsFencing(t *testing.T) {
	t.Parallel()
	forLayouts(t, func(t *testing.T, mc migrations.Config) {
		b, pm := stepsLedger(t, mc)
		ctx := context.Background()
		// Holder A has one connection: while its step holds it (or the
		// test does), A cannot renew its lease, as a process held up
		// could not; its lease of 500 ms runs out.
		poolA := b.pg.PoolVia(t, b.pg.Host(), 1)
		a, err := inbox.New(poolA, inbox.Config{DefaultTTL: b.ledger.DefaultTTL()})
		require.NoError(t, err)
		const lease = 500 * time.Millisecond

		t.Run("Tx", func(t *testing.T) {
			r := req("payments", "fence-tx")
			inside, release := make(chan struct{}), make(chan struct{})
			var tokenA int64
			errA := make(chan error, 1)
			go func() {
				_, err := a.DoSteps(ctx, r, lease, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
					tokenA = s.Token()
					_, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
						if _, err := tx.Exec(ctx, `INSERT INTO step_orders (payment, status) VALUES ('fence-tx', 'A')`); err != nil {
							return nil, err
						}
						close(inside)
						<-release // held up
						return []byte("A"), nil
					})
					return inbox.Result{}, err
				})
				errA <- err
			}()
			waitInside(t, inside, errA)
			rb := r
			rb.LockWait = 10 * time.Second
			var tokenB int64
			out, err := b.ledger.DoSteps(ctx, rb, lease, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
				tokenB = s.Token()
				out, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					_, err := tx.Exec(ctx, `INSERT INTO step_orders (payment, status) VALUES ('fence-tx', 'B')`)
					return []byte("B"), err
				})
				return inbox.Result{Body: out}, err
			})
			require.NoError(t, err)
			require.Equal(t, inbox.Executed, out.Disposition)
			require.Greater(t, tokenB, tokenA)

			close(release)
			err = <-errA
			require.ErrorIs(t, err, inbox.ErrLeaseLost)
			require.ErrorContains(t, err, "record step order")
			var status string
			require.NoError(t, b.pg.Pool.QueryRow(ctx, `SELECT string_agg(status, ',') FROM step_orders WHERE payment = 'fence-tx'`).Scan(&status))
			require.Equal(t, "B", status, "the stale holder's write rolled back")
			steps, err := b.ledger.Steps(ctx, r.Key)
			require.NoError(t, err)
			require.Len(t, steps, 1)
			require.Equal(t, tokenB, steps[0].Token)
			require.Equal(t, "B", string(steps[0].Output))
			rec, err := b.ledger.Lookup(ctx, r.Key)
			require.NoError(t, err)
			require.Equal(t, inbox.StatusDone, rec.Status)
			require.Equal(t, "B", string(rec.Result.Body))
		})

		t.Run("Call", func(t *testing.T) {
			r := req("payments", "fence-call")
			inside, release := make(chan struct{}), make(chan struct{})
			var tokenA int64
			errA := make(chan error, 1)
			go func() {
				_, err := a.DoSteps(ctx, r, lease, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
					tokenA = s.Token()
					_, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
						out := pm.p.charge(key, "A")
						close(inside)
						<-release // held up after the call, before its record
						return out, nil
					})
					return inbox.Result{}, err
				})
				errA <- err
			}()
			waitInside(t, inside, errA)
			// The test takes A's connection: A cannot renew.
			held, err := poolA.Acquire(ctx)
			require.NoError(t, err)
			rb := r
			rb.LockWait = 10 * time.Second
			var tokenB int64
			out, err := b.ledger.DoSteps(ctx, rb, lease, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
				tokenB = s.Token()
				out, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
					return pm.p.charge(key, "B"), nil
				})
				return inbox.Result{Body: out}, err
			})
			require.NoError(t, err)
			require.Equal(t, inbox.Executed, out.Disposition)
			require.Greater(t, tokenB, tokenA)
			require.True(t, strings.HasSuffix(string(out.Result.Body), "_A"), "the provider answered the repeat with the first charge")

			held.Release()
			close(release)
			err = <-errA
			require.ErrorIs(t, err, inbox.ErrLeaseLost)
			steps, err := b.ledger.Steps(ctx, r.Key)
			require.NoError(t, err)
			require.Len(t, steps, 1)
			require.Equal(t, tokenB, steps[0].Token, "the stale holder's record was refused")
			require.Equal(t, 2, pm.p.callsOf(inbox.StepKey(r.Key, "charge")), "called twice with one key: deduplicated")
		})
	})
}

// waitInside waits for a held-up holder to be inside its step, or fails
// with the holder's error.
func waitInside(t *testing.T, inside <-chan struct{}, errA <-chan error) {
	t.Helper()
	select {
	case <-inside:
	case err := <-errA:
		t.Fatalf("holder A ended before its step: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("holder A did not reach its step")
	}
}

// A call's record whose answer is lost is retried, and found recorded by
// this lease: the call does not run again.
func TestStepsRecordAnswerLost(t *testing.T) {
	t.Parallel()
	b, pm := stepsLedger(t, layouts[0].cfg)
	proxy := testsvc.Proxy(t, b.pg.Host())
	l, err := inbox.New(b.pg.PoolVia(t, proxy.Addr(), 4), inbox.Config{})
	require.NoError(t, err)
	ctx := context.Background()
	r := req("payments", "pay-lost-answer")
	var fired <-chan struct{}
	out, err := l.DoSteps(ctx, r, 30*time.Second, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		charge, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			fired = proxy.CutWhenServerSends([]byte("INSERT 0 1\x00")) // the record's answer
			return pm.p.charge(key, "x"), nil
		})
		return inbox.Result{Body: charge}, err
	})
	select {
	case <-fired:
	default:
		t.Fatal("the fault did not fire")
	}
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Equal(t, 1, pm.p.callsOf(inbox.StepKey(r.Key, "charge")))
	steps, err := l.Steps(ctx, r.Key)
	require.NoError(t, err)
	require.Equal(t, []string{"1 charge call"}, stepNames(steps))
}

func TestStepKey(t *testing.T) {
	t.Parallel()
	k := inbox.Key{Scope: "payments", Tenant: "acme", ID: "order-1"}
	key := inbox.StepKey(k, "charge")
	require.Equal(t, "EZ1djcmBFeAnzmSgTkCeRVpzRxEwVnpg", key, "stable across releases: providers remember it")
	require.Len(t, key, 32)
	seen := map[string]bool{key: true}
	for _, other := range []string{
		inbox.StepKey(k, "receipt"),
		inbox.StepKey(k, "compensate:charge"),
		inbox.StepKey(inbox.Key{Scope: "payments", Tenant: "acme2", ID: "order-1"}, "charge"),
		inbox.StepKey(inbox.Key{Scope: "payments", Tenant: "", ID: "acmeorder-1"}, "charge"),
		inbox.StepKey(inbox.Key{Scope: "refunds", Tenant: "acme", ID: "order-1"}, "charge"),
	} {
		require.False(t, seen[other], "%s repeats", other)
		seen[other] = true
	}
}

// Step names are checked; steps do not nest.
func TestStepsRefuseBadNamesAndNesting(t *testing.T) {
	t.Parallel()
	b, _ := stepsLedger(t, layouts[0].cfg)
	ctx := context.Background()
	call := func(context.Context, string) ([]byte, error) { return nil, nil }
	_, err := b.ledger.DoSteps(ctx, req("payments", "names"), 0, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		for _, name := range []string{"", "compensate:charge", "a\x00b", strings.Repeat("x", 256)} {
			_, err := s.Call(ctx, name, call)
			require.ErrorIs(t, err, inbox.ErrInvalidKey, "%q", name)
		}
		_, err := s.Tx(ctx, "outer", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := s.Call(ctx, "inner", call)
			return nil, err
		})
		require.ErrorContains(t, err, "one at a time")
		_, err = s.Call(ctx, "charge", call)
		require.NoError(t, err)
		_, err = s.Tx(ctx, "charge", func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil })
		require.ErrorContains(t, err, "recorded as a call step")
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
}

// A Postgres step's transaction begins with its function's first
// statement, whatever its form, and commits with the step's record: or not
// at all. Inside it, EventKey is the step's key and AtCommit writes travel
// with the commit.
func TestStepsTxStatementForms(t *testing.T) {
	t.Parallel()
	b, _ := stepsLedger(t, layouts[0].cfg)
	ctx := context.Background()
	b.pg.Exec(t, `CREATE TABLE forms (step text NOT NULL, v int)`)
	r := req("payments", "forms")
	insert := func(step string) string { return `INSERT INTO forms (step, v) VALUES ('` + step + `', 1)` }
	var stepEvent inbox.Key
	out, err := b.ledger.DoSteps(ctx, r, 0, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
		forms := map[string]func(ctx context.Context, tx pgx.Tx) error{
			"exec": func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO forms (step, v) VALUES ($1, $2)`, "exec", 1)
				return err
			},
			"exec-simple": func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, insert("exec-simple")+"; "+insert("exec-simple"))
				return err
			},
			"query-row": func(ctx context.Context, tx pgx.Tx) error {
				var v int
				if err := tx.QueryRow(ctx, `INSERT INTO forms (step, v) VALUES ($1, 1) RETURNING v`, "query-row").Scan(&v); err != nil {
					return err
				}
				stepEvent, _ = inbox.EventKey(ctx)
				return nil
			},
			"query": func(ctx context.Context, tx pgx.Tx) error {
				rows, err := tx.Query(ctx, `INSERT INTO forms (step, v) SELECT $1, g FROM generate_series(1, 3) g RETURNING v`, "query")
				if err != nil {
					return err
				}
				vs, err := pgx.CollectRows(rows, pgx.RowTo[int])
				if err == nil && len(vs) != 3 {
					err = fmt.Errorf("%d rows", len(vs))
				}
				return err
			},
			"batch": func(ctx context.Context, tx pgx.Tx) error {
				bt := &pgx.Batch{}
				bt.Queue(`INSERT INTO forms (step, v) VALUES ($1, 1)`, "batch")
				bt.Queue(`INSERT INTO forms (step, v) VALUES ($1, 2)`, "batch")
				return tx.SendBatch(ctx, bt).Close()
			},
			"savepoint": func(ctx context.Context, tx pgx.Tx) error {
				sp, err := tx.Begin(ctx)
				if err != nil {
					return err
				}
				if _, err := sp.Exec(ctx, `INSERT INTO forms (step, v) VALUES ($1, 1)`, "savepoint"); err != nil {
					return err
				}
				return sp.Commit(ctx)
			},
			"at-commit": func(ctx context.Context, tx pgx.Tx) error {
				if !inbox.AtCommit(ctx, tx, `INSERT INTO forms (step, v) VALUES ($1, 1)`, "at-commit") {
					return errors.New("AtCommit refused")
				}
				return nil
			},
			"nothing": func(context.Context, pgx.Tx) error { return nil },
		}
		for name, f := range forms {
			if _, err := s.Tx(ctx, name, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				return []byte(name), f(ctx, tx)
			}); err != nil {
				return inbox.Result{}, fmt.Errorf("%s: %w", name, err)
			}
		}
		// A step that swallows a failed statement, or ends the
		// transaction itself, records nothing and leaves nothing.
		_, err := s.Tx(ctx, "swallowed", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, _ = tx.Exec(ctx, `INSERT INTO forms (step, v) VALUES ($1, 'not a number')`, "swallowed")
			return nil, nil
		})
		if !errors.Is(err, inbox.ErrRolledBack) {
			return inbox.Result{}, fmt.Errorf("swallowed: %v", err)
		}
		_, err = s.Tx(ctx, "owned", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if _, err := tx.Exec(ctx, `INSERT INTO forms (step, v) VALUES ($1, 1)`, "owned"); err != nil {
				return nil, err
			}
			_, err := tx.Exec(ctx, `COMMIT`)
			return nil, err
		})
		if !errors.Is(err, inbox.ErrTxOwned) {
			return inbox.Result{}, fmt.Errorf("owned: %v", err)
		}
		return inbox.Result{}, nil
	})
	require.NoError(t, err)
	require.Equal(t, inbox.Executed, out.Disposition)
	require.Equal(t, inbox.Key{Scope: r.Scope, ID: inbox.StepKey(r.Key, "query-row")}, stepEvent)
	counts := map[string]int{}
	rows, err := b.pg.Pool.Query(ctx, `SELECT step, count(*) FROM forms GROUP BY step`)
	require.NoError(t, err)
	var step string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&step, &n}, func() error { counts[step] = n; return nil })
	require.NoError(t, err)
	require.Equal(t, map[string]int{"exec": 1, "exec-simple": 2, "query-row": 1, "query": 3, "batch": 2,
		"savepoint": 1, "at-commit": 1, "owned": 1}, counts, "the owned step's COMMIT let its row through, unrecorded")
	steps, err := b.ledger.Steps(ctx, r.Key)
	require.NoError(t, err)
	require.Len(t, steps, 8)
	for _, st := range steps {
		require.Equal(t, st.Name, string(st.Output))
	}
}

// On the time-bucket layout a takeover that moves the key's row to a newer
// bucket while a stale holder's record waits for that row refuses the
// record too (Postgres reports the row moved): ErrLeaseLost.
func TestStepsFencingAcrossABucketMove(t *testing.T) {
	t.Parallel()
	b := bucketsLedger(t, time.Hour, time.Hour)
	ctx := context.Background()
	r := req("payments", "fence-move")
	r.Fingerprint = []byte("fp")
	inside, release := make(chan struct{}), make(chan struct{})
	errA := make(chan error, 1)
	go func() {
		// A long lease: A renews nothing while the test runs.
		_, err := b.ledger.DoSteps(ctx, r, time.Hour, func(ctx context.Context, s *inbox.Steps) (inbox.Result, error) {
			_, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
				close(inside)
				<-release
				return []byte("A"), nil
			})
			return inbox.Result{}, err
		})
		errA <- err
	}()
	waitInside(t, inside, errA)
	before := bucketOf(t, b, r.ID)

	// An hour passes: A's lease runs out. The shard's next bucket opens,
	// and another caller takes the key over, moving its row there; its
	// transaction is still open when A records.
	b.pg.Exec(t, `UPDATE processed_events SET lease_until = now() - interval '1 second' WHERE event_id = $1`, r.ID)
	openNext(t, b)
	tx, err := b.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var claimed bool
	require.NoError(t, tx.QueryRow(ctx, `SELECT o_claimed FROM processed_events_claim($1, $2, $3, $4, 'kafka', '',
		$5, $6::bigint # (('processed_events'::regclass)::oid::bigint << 32), $7, 'B', false)`,
		r.Scope, r.Tenant, r.ID, r.Fingerprint, time.Hour.Microseconds(), ledgerkey.Hash(r.Scope, r.Tenant, r.ID),
		time.Minute.Microseconds()).Scan(&claimed))
	require.True(t, claimed)

	close(release)
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return b.pg.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1
			AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO%processed_steps%'`, b.pg.Schema) == 1
	}, "A's record waits for the row")
	require.NoError(t, tx.Commit(ctx))
	require.NotEqual(t, before, bucketOf(t, b, r.ID), "the takeover moved the row")
	err = <-errA
	require.ErrorIs(t, err, inbox.ErrLeaseLost)
	require.ErrorContains(t, err, "moved to another partition")
	require.Zero(t, b.pg.Count(t, `SELECT count(*) FROM processed_steps WHERE event_id = $1`, r.ID))
}
