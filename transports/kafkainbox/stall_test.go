package kafkainbox_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// publishTo writes msgs, in order, to one partition of topic.
func publishTo(t testing.TB, brokers []string, topic string, partition int, msgs ...kafka.Message) {
	t.Helper()
	tr := &kafka.Transport{}
	w := &kafka.Writer{
		Addr:         kafka.TCP(brokers...),
		Topic:        topic,
		Balancer:     kafka.BalancerFunc(func(kafka.Message, ...int) int { return partition }),
		RequiredAcks: kafka.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		Transport:    tr,
	}
	defer func() {
		_ = w.Close()
		tr.CloseIdleConnections()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	require.NoError(t, w.WriteMessages(ctx, msgs...))
}

// A message whose handler returns nil but whose transaction fails at
// COMMIT (a deferred constraint) is a counted handler failure: it is
// retried in place, in its partition, then dead-lettered and recorded
// failed. While it waits between attempts, the other partition's messages
// all run, with a Concurrency of 1; the messages behind it in its
// own partition run after it, in order.
func TestRetryingMessageDoesNotStallOtherPartitions(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	fx.pg.Exec(t, `CREATE TABLE strict (id int, CONSTRAINT strict_once UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)`)
	topic := newTopic(t, brokers, 2)
	group := "g-" + topic
	const behind, other, maxAttempts = 5, 20, 6

	publishTo(t, brokers, topic, 0, append([]kafka.Message{kafkainbox.NewMessage("poison", nil, []byte("x"))}, events("a", 0, behind, 1)...)...)

	var (
		mu            sync.Mutex
		attempts      []int // the poison's m.Attempt, per run
		bRan          int
		poisonAtBDone = -1 // poison runs when the last b ran
		deadAt        time.Time
		aFirstAt      time.Time // when a-0's effect committed
	)
	pc := fx.processor()
	pc.MaxAttempts = maxAttempts
	// Each wait 0.75-1.5 s: the poison's retry budget is 3.75-7.5 s.
	pc.Backoff = backoff.Backoff{Initial: 1500 * time.Millisecond, Max: 1500 * time.Millisecond}
	// When a-0's effect committed: a batch that failed at COMMIT may have
	// called its handler before, and rolled it back.
	onOutcome := pc.Hooks.OnOutcome
	pc.Hooks.OnOutcome = func(m *consumer.Message, out inbox.Outcome, took time.Duration) {
		onOutcome(m, out, took)
		if m.ID == "a-0" && out.Disposition == inbox.Executed {
			mu.Lock()
			aFirstAt = time.Now()
			mu.Unlock()
		}
	}
	pc.Hooks.OnDeadLetter = func(m *consumer.Message, _ error) {
		mu.Lock()
		defer mu.Unlock()
		deadAt = time.Now()
	}
	stop := start(t, kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: pc, Scheduling: consumer.Scheduling{Concurrency: 1}},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			mu.Lock()
			switch {
			case m.ID == "poison":
				attempts = append(attempts, m.Attempt)
				mu.Unlock()
				// Returns nil; COMMIT fails with 23505.
				_, err := tx.Exec(ctx, `INSERT INTO strict VALUES (1), (1)`)
				return err
			case m.Partition == 1:
				bRan++
				if bRan == other {
					poisonAtBDone = len(attempts)
				}
			}
			mu.Unlock()
			return fx.insert(ctx, tx, m)
		})
	// Partition 1's messages are published once the poison has failed.
	testsvc.Eventually(t, 60*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(attempts) >= 1
	}, "the poison's first attempt")
	publishTo(t, brokers, topic, 1, events("b", 0, other, 1)...)
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) >= behind+other }, "every good message runs")
	waitNoLag(t, brokers, group, topic)
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
	require.Less(t, poisonAtBDone, maxAttempts, "partition 1 finished while the poison was still retrying (after %d of its %d attempts)", poisonAtBDone, maxAttempts)
	require.False(t, deadAt.IsZero(), "the poison was dead-lettered")
	require.True(t, aFirstAt.After(deadAt), "the messages behind the poison ran after it")

	fx.assertExactlyOnce(t, behind+other)
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM strict`), "the poison's writes rolled back")
	rec, err := fx.ledger.Lookup(context.Background(), inbox.Key{Scope: group, ID: "poison"})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusFailed, rec.Status)
	dl := readAll(t, brokers, topic+kafkainbox.DeadLetterSuffix)
	require.Len(t, dl, 1)
	h := map[string]string{}
	for _, hd := range dl[0].Headers {
		h[hd.Key] = string(hd.Value)
	}
	require.Equal(t, "poison", h[consumer.HeaderDLID])
	require.Equal(t, strconv.Itoa(maxAttempts), h[consumer.HeaderDLAttempts])
	require.Contains(t, h[consumer.HeaderDLError], "23505")
	t.Logf("partition 1 done after %d of the poison's %d attempts", poisonAtBDone, maxAttempts)
}
