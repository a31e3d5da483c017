package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// A steps handler that fails retryably on every attempt: each attempt
// resumes after the recorded charge, and the last one, which dead-letters,
// refunds it first.
func TestStepsLastAttemptCompensates(t *testing.T) {
	t.Parallel()
	f := setup(t)
	cfg := f.cfg()
	cfg.Steps = true
	var calls, charges, refunds atomic.Int64
	var refundKey atomic.Value
	p, err := consumer.New(cfg, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		calls.Add(1)
		s := consumer.Steps(ctx)
		require.NotNil(t, s)
		require.Nil(t, tx)
		s.Compensate("charge", func(ctx context.Context, key string, out []byte) error {
			refunds.Add(1)
			refundKey.Store(key + " " + string(out))
			return nil
		})
		if _, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			charges.Add(1)
			return []byte("ch_1"), nil
		}); err != nil {
			return err
		}
		return errors.New("mailer down")
	})
	require.NoError(t, err)
	d := p.ProcessWithRetry(context.Background(), msg("pay-1"), nil)
	require.Equal(t, consumer.Ack, d.Action)
	require.True(t, d.DeadLettered)
	require.ErrorContains(t, d.Err, "mailer down")
	require.EqualValues(t, 3, calls.Load(), "MaxAttempts")
	require.EqualValues(t, 1, charges.Load(), "the recorded charge is not run again")
	require.EqualValues(t, 1, refunds.Load(), "the last attempt compensates before dead-lettering")
	k := inbox.Key{Scope: "test", ID: "pay-1"}
	require.Equal(t, inbox.StepKey(k, "compensate:charge")+" ch_1", refundKey.Load())
	require.Len(t, f.dead, 1)
	rec, err := f.ledger.Lookup(context.Background(), k)
	require.NoError(t, err)
	require.Equal(t, inbox.StatusFailed, rec.Status)

	// A redelivery runs nothing.
	d = p.Process(context.Background(), msg("pay-1"))
	require.Equal(t, consumer.Ack, d.Action)
	require.Equal(t, inbox.Duplicate, d.Outcome.Disposition)
	require.EqualValues(t, 3, calls.Load())
}

// A steps handler that succeeds: its result is recorded and replayed, and
// ProcessRun never batches it with the messages behind it.
func TestStepsRunAloneAndReplay(t *testing.T) {
	t.Parallel()
	f := setup(t)
	cfg := f.cfg()
	cfg.Steps = true
	var calls atomic.Int64
	p, err := consumer.New(cfg, func(ctx context.Context, _ pgx.Tx, m *consumer.Message) error {
		calls.Add(1)
		out, err := consumer.Steps(ctx).Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID)
			return []byte("order-" + m.ID), err
		})
		consumer.SetResult(ctx, inbox.Result{Code: 201, Body: out})
		return err
	})
	require.NoError(t, err)
	ctx := context.Background()
	ds := p.ProcessRun(ctx, []*consumer.Message{msg("a"), msg("b"), msg("c")}, consumer.RunLimits{})
	require.Len(t, ds, 1, "one message a run")
	require.Equal(t, inbox.Executed, ds[0].Outcome.Disposition)
	d := p.Process(ctx, msg("a"))
	require.Equal(t, inbox.Duplicate, d.Outcome.Disposition)
	require.Equal(t, "order-a", string(d.Outcome.Result.Body))
	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 1, f.pg.Count(t, `SELECT count(*) FROM effects`))
}

func TestStepsConfig(t *testing.T) {
	t.Parallel()
	f := setup(t)
	cfg := f.cfg()
	cfg.Steps, cfg.AllowNoID = true, true
	_, err := consumer.New(cfg, f.insert)
	require.ErrorIs(t, err, inbox.ErrConfig)
	require.Nil(t, consumer.Steps(context.Background()))
	require.True(t, consumer.IsPermanent(inbox.Permanent(errors.New("x"))))
	require.ErrorIs(t, consumer.Permanent(errors.New("x")), inbox.ErrPermanent)
	require.NoError(t, consumer.Permanent(nil))
}
