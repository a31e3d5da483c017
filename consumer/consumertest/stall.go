package consumertest

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// testStall: a message whose handler returns nil but whose transaction
// fails at COMMIT (a deferred constraint) is a counted handler failure: it
// is retried in place, in its lane, then dead-lettered and recorded
// failed. While it waits between attempts, the other lane's messages all
// run, with a Concurrency of 1; the messages behind it in its own lane run
// after it, in order. With Features.Batch, in batch mode: the messages
// behind the poison first wait in its batch.
func testStall(t *testing.T, s *suite) {
	h := s.h.(StallHarness)
	fx := newFixture(t, h)
	fx.exec(t, `CREATE TABLE strict (id int, CONSTRAINT strict_once UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)`)
	topic := h.NewTopic(t)
	group, scope := "g-"+topic, "stall-"+topic
	const poison, behind, other, maxAttempts = "poison", 5, 20, 6

	h.PublishLane(t, topic, 0, append([]Msg{{ID: poison, Value: []byte("x")}}, events("a", 0, behind, 1)...))

	var (
		mu            sync.Mutex
		attempts      []int // the poison's m.Attempt, per run
		otherRan      int
		poisonAtOther = -1 // poison runs when the other lane's last message ran
		deadAt        time.Time
		aFirstAt      time.Time // when a-0's effect committed
	)
	opts := fx.options(scope, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		switch {
		case m.ID == poison:
			attempts = append(attempts, m.Attempt)
			mu.Unlock()
			// Returns nil; COMMIT fails with 23505.
			_, err := tx.Exec(ctx, `INSERT INTO strict VALUES (1), (1)`)
			return err
		case strings.HasPrefix(m.ID, "b-"):
			otherRan++
			if otherRan == other {
				poisonAtOther = len(attempts)
			}
		}
		mu.Unlock()
		return fx.insert(ctx, tx, m)
	})
	opts.Config.MaxAttempts = maxAttempts
	// Each wait 0.75-1.5 s: the poison's retry budget is 3.75-7.5 s.
	opts.Config.Backoff = backoff.Backoff{Initial: 1500 * time.Millisecond, Max: 1500 * time.Millisecond}
	// When a-0's effect committed: a batch that failed at COMMIT may have
	// called its handler before, and rolled it back.
	onOutcome := opts.Config.Hooks.OnOutcome
	opts.Config.Hooks.OnOutcome = func(m *consumer.Message, out inbox.Outcome, took time.Duration) {
		onOutcome(m, out, took)
		if m.ID == "a-0" && out.Disposition == inbox.Executed {
			mu.Lock()
			aFirstAt = time.Now()
			mu.Unlock()
		}
	}
	opts.Config.Hooks.OnDeadLetter = func(*consumer.Message, error) {
		mu.Lock()
		defer mu.Unlock()
		deadAt = time.Now()
	}
	opts.Concurrency = 1
	if s.f.Batch {
		opts.BatchSize = consumer.DefaultBatchSize
	}
	stop := h.Start(t, topic, group, opts)
	// The other lane's messages are published once the poison has failed.
	eventually(t, 60*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(attempts) >= 1
	}, "the poison's first attempt")
	h.PublishLane(t, topic, 1, events("b", 0, other, 1))
	eventually(t, 60*time.Second, func() bool { return fx.effects(t) >= behind+other }, "every good message runs")
	waitAcked(t, h, topic, group)
	stop()

	mu.Lock()
	defer mu.Unlock()
	if len(attempts) > 1 && attempts[0] == 1 && attempts[1] == 1 {
		// The first run was in a batch (the messages behind it were
		// waiting): a failure at COMMIT cannot be pinned on one of a
		// batch's savepoints, so that run counted against nobody and
		// each message of the batch ran again alone.
		attempts = attempts[1:]
	}
	require.Equal(t, []int{1, 2, 3, 4, 5, 6}, attempts, "each failure at COMMIT counted an attempt")
	require.Less(t, poisonAtOther, maxAttempts, "the other lane finished while the poison was still retrying (after %d of its %d attempts)", poisonAtOther, maxAttempts)
	require.False(t, deadAt.IsZero(), "the poison was dead-lettered")
	require.True(t, aFirstAt.After(deadAt), "the messages behind the poison ran after it")

	fx.assertExactlyOnce(t, behind+other)
	require.Zero(t, fx.count(t, `SELECT count(*) FROM strict`), "the poison's writes rolled back")
	rec, err := fx.ledger.Lookup(context.Background(), inbox.Key{Scope: scope, ID: poison})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusFailed, rec.Status)
	dl := h.DeadLetters(t, topic)
	require.Len(t, dl, 1)
	require.Equal(t, poison, dl[0].ID)
	require.Equal(t, strconv.Itoa(maxAttempts), dl[0].Headers[consumer.HeaderDLAttempts])
	require.Contains(t, dl[0].Headers[consumer.HeaderDLError], "23505")
	t.Logf("the other lane done after %d of the poison's %d attempts", poisonAtOther, maxAttempts)
}
