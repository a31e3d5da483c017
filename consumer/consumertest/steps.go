package consumertest

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// stepsRun counts what a steps handler did, per event ID and per step
// key: its calls, its charges (the outside step's function) and refunds
// (the compensation's).
type stepsRun struct {
	mu       sync.Mutex
	calls    map[string]int
	charges  map[string]int // by step key
	refunds  map[string]int // by compensation key
	replayed map[string]string
}

// testSteps runs a handler of three steps (an order row, a charge, a
// receipt row) with Config.Steps: the first call for every event fails
// after the order and the charge, retryably, so the next attempt must
// resume after them; one event fails permanently after its charge, so its
// charge must be refunded (the declared compensation) and the event
// dead-lettered; a fifth of the events are published again, and their
// duplicates must replay the recorded result without running anything.
func testSteps(t *testing.T, h Harness, batch int) {
	fx := newFixture(t, h)
	topic := h.NewTopic(t)
	const unique, dups = 60, 12
	msgs := ids("pay", 0, unique)
	const refusedID = "refused-1"
	all := append(append([]Msg{}, msgs[:unique/2]...), Msg{ID: refusedID, Key: "0", Value: []byte(refusedID)})
	all = append(all, msgs[unique/2:]...)
	for i := 0; i < dups; i++ {
		all = append(all, msgs[(i*5)%unique])
	}
	all = append(all, Msg{ID: refusedID, Key: "0", Value: []byte(refusedID)})

	r := &stepsRun{calls: map[string]int{}, charges: map[string]int{}, refunds: map[string]int{}, replayed: map[string]string{}}
	row := func(ctx context.Context, tx pgx.Tx, id, what string) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO effects (event_id, value) VALUES ($1, $2)`, id, []byte(what))
		return nil, err
	}
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		s := consumer.Steps(ctx)
		if s == nil || tx != nil {
			return consumer.Permanent(errors.New("not run in steps"))
		}
		r.mu.Lock()
		r.calls[m.ID]++
		first := r.calls[m.ID] == 1
		r.mu.Unlock()
		s.Compensate("charge", func(ctx context.Context, key string, _ []byte) error {
			r.mu.Lock()
			r.refunds[key]++
			r.mu.Unlock()
			return nil
		})
		if _, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) { return row(ctx, tx, m.ID, "order") }); err != nil {
			return err
		}
		charge, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			r.mu.Lock()
			r.charges[key]++
			r.mu.Unlock()
			return []byte("ch-" + m.ID), nil
		})
		if err != nil {
			return err
		}
		if first {
			return errors.New("mailer down") // retryable: the order and the charge stay recorded
		}
		if m.ID == refusedID {
			return consumer.Permanent(errors.New("card refused"))
		}
		if _, err := s.Tx(ctx, "receipt", func(ctx context.Context, tx pgx.Tx) ([]byte, error) { return row(ctx, tx, m.ID, "receipt") }); err != nil {
			return err
		}
		consumer.SetResult(ctx, inbox.Result{Code: 201, Body: charge})
		return nil
	}
	opts := fx.options("steps-"+topic, handler)
	opts.Config.Steps = true
	opts.BatchSize = batch
	seen := opts.Config.Hooks.OnOutcome
	opts.Config.Hooks.OnOutcome = func(m *consumer.Message, out inbox.Outcome, took time.Duration) {
		seen(m, out, took)
		if out.Disposition == inbox.Duplicate && out.Result.Code == 201 {
			r.mu.Lock()
			r.replayed[m.ID] = string(out.Result.Body)
			r.mu.Unlock()
		}
	}
	h.Publish(t, topic, all)
	stop := h.Start(t, topic, "g-"+topic, opts)
	eventually(t, 90*time.Second, func() bool {
		return fx.seen.Load() >= unique+dups && len(h.DeadLetters(t, topic)) >= 1
	}, "all %d deliveries answered (got %d) and the refused payment dead-lettered", unique+dups, fx.seen.Load())
	waitAcked(t, h, topic, "g-"+topic)
	stop()

	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range msgs {
		k := inbox.Key{Scope: "steps-" + topic, ID: m.ID}
		require.Equal(t, 1, r.charges[inbox.StepKey(k, "charge")], "charges of %s: the step recorded on attempt 1 must not run on attempt 2", m.ID)
		require.GreaterOrEqual(t, r.calls[m.ID], 2, "handler calls of %s", m.ID)
		require.Equal(t, 1, fx.count(t, `SELECT count(*) FROM effects WHERE event_id = $1 AND value = 'order'`, m.ID), "order rows of %s", m.ID)
		require.Equal(t, 1, fx.count(t, `SELECT count(*) FROM effects WHERE event_id = $1 AND value = 'receipt'`, m.ID), "receipts of %s", m.ID)
	}
	for i := 0; i < dups; i++ {
		id := msgs[(i*5)%unique].ID
		require.Equal(t, "ch-"+id, r.replayed[id], "the duplicate of %s replays the recorded result", id)
	}
	require.Equal(t, unique, fx.count(t, `SELECT count(*) FROM processed_events WHERE status = 'done'`), "keys done")

	// The refused payment: charged once, refunded once with the
	// compensation's own key, no receipt, recorded failed, dead-lettered
	// once although delivered twice.
	k := inbox.Key{Scope: "steps-" + topic, ID: refusedID}
	require.Equal(t, 1, r.charges[inbox.StepKey(k, "charge")], "charges of the refused payment")
	require.Equal(t, map[string]int{inbox.StepKey(k, "compensate:charge"): 1}, r.refunds, "refunds")
	require.Equal(t, 0, fx.count(t, `SELECT count(*) FROM effects WHERE event_id = $1 AND value = 'receipt'`, refusedID))
	require.Equal(t, 1, fx.count(t, `SELECT count(*) FROM processed_events WHERE status = 'failed' AND event_id = $1`, refusedID))
	steps, err := fx.ledger.Steps(context.Background(), k)
	require.NoError(t, err)
	var names []string
	for _, st := range steps {
		names = append(names, st.Name+":"+string(st.Kind))
	}
	require.Equal(t, "order:tx charge:call :failed compensate:charge:compensate", strings.Join(names, " "))
	dl := h.DeadLetters(t, topic)
	require.Len(t, dl, 1)
	require.Equal(t, refusedID, dl[0].ID)
	require.Contains(t, dl[0].Headers[consumer.HeaderDLError], "card refused")
}
