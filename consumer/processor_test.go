package consumer_test

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

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/migrations"
)

type fx struct {
	pg     *testsvc.PG
	ledger *inbox.Ledger
	runs   atomic.Int64
	dead   []*consumer.Message
	mu     sync.Mutex
}

func setup(t *testing.T) *fx {
	pg := testsvc.Postgres(t)
	pg.Exec(t, `CREATE TABLE effects (event_id text NOT NULL)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	return &fx{pg: pg, ledger: l}
}

func (f *fx) cfg() consumer.Config {
	return consumer.Config{
		Ledger: f.ledger, Scope: "test", Source: inbox.Source("kafka"), MaxAttempts: 3,
		Backoff: backoff.Backoff{Initial: time.Millisecond, Max: 2 * time.Millisecond},
		DeadLetter: func(_ context.Context, m *consumer.Message, _ error) error {
			f.mu.Lock()
			defer f.mu.Unlock()
			f.dead = append(f.dead, m)
			return nil
		},
	}
}

func (f *fx) insert(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	f.runs.Add(1)
	_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID)
	return err
}

func msg(id string) *consumer.Message {
	m := &consumer.Message{Topic: "t", Value: []byte(id)}
	if id != "" {
		m.Headers = []consumer.Header{{Key: "ce_id", Value: []byte(id)}}
	}
	return m
}

func TestProcessRunsOnceAndAcksDuplicates(t *testing.T) {
	t.Parallel()
	f := setup(t)
	p, err := consumer.New(f.cfg(), f.insert)
	require.NoError(t, err)
	ctx := context.Background()
	d := p.Process(ctx, msg("e1"))
	require.Equal(t, consumer.Ack, d.Action)
	require.Equal(t, inbox.Executed, d.Outcome.Disposition)
	d = p.Process(ctx, msg("e1"))
	require.Equal(t, consumer.Ack, d.Action)
	require.Equal(t, inbox.Duplicate, d.Outcome.Disposition)
	require.EqualValues(t, 1, f.runs.Load())
	require.Equal(t, 1, f.pg.Count(t, `SELECT count(*) FROM effects`))
}

func TestRetryThenDeadLetter(t *testing.T) {
	t.Parallel()
	f := setup(t)
	var calls atomic.Int64
	p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		calls.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, m.ID); err != nil {
			return err
		}
		return errors.New("downstream refused")
	})
	require.NoError(t, err)
	d := p.ProcessWithRetry(context.Background(), msg("bad"), nil)
	require.Equal(t, consumer.Ack, d.Action)
	require.True(t, d.DeadLettered)
	require.EqualValues(t, 3, calls.Load())
	require.Len(t, f.dead, 1)
	require.Equal(t, 3, f.dead[0].Attempt)
	require.Equal(t, 0, f.pg.Count(t, `SELECT count(*) FROM effects`), "failed attempts roll back")
	rec, err := f.ledger.Lookup(context.Background(), inbox.Key{Scope: "test", ID: "bad"})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusFailed, rec.Status)
	require.Equal(t, 3, rec.Attempts)
	require.Contains(t, rec.Error, "downstream refused")

	// A redelivery of a dead-lettered event does not run again.
	d = p.Process(context.Background(), msg("bad"))
	require.Equal(t, consumer.Ack, d.Action)
	require.Equal(t, inbox.Duplicate, d.Outcome.Disposition)
	require.EqualValues(t, 3, calls.Load())
}

func TestPermanentAndPanic(t *testing.T) {
	t.Parallel()
	f := setup(t)
	p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "panic" {
			panic("nil map")
		}
		return consumer.Permanent(errors.New("schema violation"))
	})
	require.NoError(t, err)
	d := p.Process(context.Background(), msg("perm"))
	require.True(t, d.DeadLettered)
	require.Equal(t, 1, f.dead[0].Attempt)

	d = p.Process(context.Background(), msg("panic"))
	require.Equal(t, consumer.Retry, d.Action)
	var pe *consumer.PanicError
	require.ErrorAs(t, d.Err, &pe)
	require.True(t, d.Counted)
}

func TestNoIDIsDeadLetteredOrRunWhenAllowed(t *testing.T) {
	t.Parallel()
	f := setup(t)
	p, err := consumer.New(f.cfg(), f.insert)
	require.NoError(t, err)
	d := p.Process(context.Background(), msg(""))
	require.True(t, d.DeadLettered)
	require.ErrorIs(t, d.Err, consumer.ErrNoID)
	require.Len(t, f.dead, 1)

	cfg := f.cfg()
	cfg.AllowNoID = true
	p, err = consumer.New(cfg, f.insert)
	require.NoError(t, err)
	d = p.Process(context.Background(), msg(""))
	require.Equal(t, consumer.Ack, d.Action)
	require.Equal(t, 1, f.pg.Count(t, `SELECT count(*) FROM effects`))

	// An ID over the ledger's limit is rejected up front and dead-lettered.
	d = p.Process(context.Background(), msg(strings.Repeat("x", 300)))
	require.True(t, d.DeadLettered)
	require.ErrorIs(t, d.Err, inbox.ErrInvalidKey)
}

func TestIDExtractors(t *testing.T) {
	t.Parallel()
	m := &consumer.Message{Value: []byte(`{"id": 12345678901234567890, "type":"x"}`)}
	id, err := consumer.JSONField("id")(m)
	require.NoError(t, err)
	require.Equal(t, "12345678901234567890", id)
	_, err = consumer.JSONField("missing")(m)
	require.ErrorIs(t, err, consumer.ErrNoID)
	m.Headers = []consumer.Header{{Key: "EVENT-ID", Value: []byte("h1")}}
	id, err = consumer.DefaultID(m)
	require.NoError(t, err)
	require.Equal(t, "h1", id)
	id, err = consumer.FirstID(consumer.HeaderID("x"), consumer.JSONField("type"))(m)
	require.NoError(t, err)
	require.Equal(t, "x", id)
}

func TestSetResultIsStored(t *testing.T) {
	t.Parallel()
	f := setup(t)
	p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		consumer.SetResult(ctx, inbox.Result{Code: 201, Body: []byte(`{"paid":true}`)})
		return nil
	})
	require.NoError(t, err)
	p.Process(context.Background(), msg("r1"))
	rec, err := f.ledger.Lookup(context.Background(), inbox.Key{Scope: "test", ID: "r1"})
	require.NoError(t, err)
	require.Equal(t, 201, rec.Result.Code)
	require.Equal(t, inbox.Source("kafka"), rec.Source)
}

func TestBatchIsolatesPoison(t *testing.T) {
	t.Parallel()
	f := setup(t)
	var poisonCalls atomic.Int64
	p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if m.ID == "p" {
			poisonCalls.Add(1)
			return errors.New("poison")
		}
		return f.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	ctx := context.Background()
	// Pre-existing: e0 ran already.
	require.Equal(t, consumer.Ack, p.Process(ctx, msg("e0")).Action)

	var msgs []*consumer.Message
	for i := 0; i < 10; i++ {
		msgs = append(msgs, msg(fmt.Sprintf("e%d", i)))
	}
	msgs = append(msgs, msg("p"), msg("e3"), msg(""))
	ds := p.ProcessBatch(ctx, msgs)
	require.Len(t, ds, len(msgs))
	require.Equal(t, inbox.Duplicate, ds[0].Outcome.Disposition)
	for i := 1; i < 10; i++ {
		require.Equal(t, consumer.Ack, ds[i].Action, i)
		require.Equal(t, inbox.Executed, ds[i].Outcome.Disposition, i)
	}
	require.Equal(t, consumer.Retry, ds[10].Action, "the poison alone is retried")
	require.Equal(t, inbox.Duplicate, ds[11].Outcome.Disposition)
	require.True(t, ds[12].DeadLettered, "no ID")
	require.Equal(t, 10, f.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, 10, f.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`))

	// All new and healthy: one transaction, every message executed, and
	// the handler called once per message (no split into single runs).
	var batch []*consumer.Message
	for i := 20; i < 30; i++ {
		batch = append(batch, msg(fmt.Sprintf("e%d", i)))
	}
	before := f.runs.Load()
	for _, d := range p.ProcessBatch(ctx, batch) {
		require.Equal(t, inbox.Executed, d.Outcome.Disposition)
		require.True(t, d.HandlerRan)
	}
	require.EqualValues(t, 10, f.runs.Load()-before)
	require.Equal(t, 20, f.pg.Count(t, `SELECT count(*) FROM effects`))
}

func TestStoreDownIsRetriedNotCounted(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m := msg("x")
	// Terminate the pool's connections while a handler runs: the attempt
	// fails with a store error, is retried without counting, and runs once.
	var once sync.Once
	var calls, terminated atomic.Int64
	p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		calls.Add(1)
		once.Do(func() { terminated.Add(int64(f.pg.TerminateBackends(t))) })
		return f.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	d := p.ProcessWithRetry(ctx, m, nil)
	require.Equal(t, consumer.Ack, d.Action)
	require.Positive(t, terminated.Load(), "the handler's connection was terminated")
	require.EqualValues(t, 2, calls.Load(), "the first attempt failed and was retried")
	require.Equal(t, 1, m.Attempt, "the retry did not count")
	require.Equal(t, 1, m.Uncounted, "the retry after the handler ran is tracked")
	require.Equal(t, 1, f.pg.Count(t, `SELECT count(*) FROM effects`))
	require.Equal(t, consumer.Ack, p.Process(ctx, msg("x")).Action)
	require.EqualValues(t, 2, calls.Load(), "the redelivery is a duplicate")
	require.Equal(t, 1, f.pg.Count(t, `SELECT count(*) FROM effects`))
}

// A ledger that cannot claim for a reason that is not the event's (here
// its table does not exist yet: consumers started before the migration)
// dead-letters nothing: every event would fail the same way. The attempts
// are not counted, and once the table is there the event runs once.
func TestLedgerFaultIsNotTheEventsFailure(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.NoMigrate())
	pg.Exec(t, `CREATE TABLE effects (event_id text NOT NULL)`)
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(t, err)
	f := &fx{pg: pg, ledger: l}
	p, err := consumer.New(f.cfg(), func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		return f.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	ctx := context.Background()
	m := msg("early")
	for i := 0; i < 5; i++ { // more than MaxAttempts
		d := p.Process(ctx, m)
		require.Equal(t, consumer.Retry, d.Action, "attempt %d: %v", i, d.Err)
		require.False(t, d.Counted)
		require.False(t, d.HandlerRan)
		require.ErrorIs(t, d.Err, inbox.ErrStore)
	}
	require.Empty(t, f.dead, "nothing dead-lettered")
	require.Equal(t, 1, m.Attempt, "no attempt counted beyond the first")

	_, err = migrations.New(pg.Pool, migrations.Config{Schema: pg.Schema}).Up(ctx)
	require.NoError(t, err)
	d := p.Process(ctx, m)
	require.Equal(t, consumer.Ack, d.Action, "%v", d.Err)
	require.EqualValues(t, 1, f.runs.Load())
	require.Equal(t, 1, pg.Count(t, `SELECT count(*) FROM effects`))
}

// The last counted attempt ends with a COMMIT whose answer was lost, and
// the COMMIT had gone through: the message is acked as done, not
// dead-lettered.
func TestCommitUnknownOnTheLastAttemptIsLookedUp(t *testing.T) {
	t.Parallel()
	f := setup(t)
	proxy := testsvc.Proxy(t, f.pg.Host())
	l, err := inbox.New(f.pg.PoolVia(t, proxy.Addr(), 2), inbox.Config{})
	require.NoError(t, err)
	f.ledger = l
	cfg := f.cfg()
	cfg.MaxAttempts = 1
	cfg.MaxUncounted = 1
	cfg.StoreBackoff = backoff.Backoff{Initial: time.Millisecond, Max: 2 * time.Millisecond}
	var attempts atomic.Int64
	var fired []<-chan struct{}
	p, err := consumer.New(cfg, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if attempts.Add(1) == 1 {
			// The handler's own write's answer is lost: nothing commits,
			// and the retry does not count.
			fired = append(fired, proxy.CutWhenServerSends([]byte("INSERT 0 1\x00")))
		} else {
			// The COMMIT's answer is lost: the retries that do not count
			// are used up, so this attempt counts, and it was the last.
			fired = append(fired, proxy.CutWhenServerSends([]byte("COMMIT\x00")))
		}
		return f.insert(ctx, tx, m)
	})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	d := p.ProcessWithRetry(ctx, msg("x"), nil)
	require.EqualValues(t, 2, attempts.Load())
	for i, ch := range fired {
		select {
		case <-ch:
		default:
			t.Fatalf("fault %d did not fire", i)
		}
	}
	require.Equal(t, consumer.Ack, d.Action, "%v", d.Err)
	require.False(t, d.DeadLettered)
	require.Empty(t, f.dead)
	require.Equal(t, inbox.Duplicate, d.Outcome.Disposition)
	require.Equal(t, 1, f.pg.Count(t, `SELECT count(*) FROM effects`))
}
