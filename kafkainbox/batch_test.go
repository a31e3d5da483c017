package kafkainbox_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/internal/testsvc"
	"github.com/justonce/justonce/kafkainbox"
)

// Batch mode keeps the guarantees: duplicates (in a batch, across batches,
// after a restart) run once, poison messages in a batch are dead-lettered
// alone while the rest of their batch commits, and every offset is acked.
func TestBatchModeGuarantees(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 4)
	group := "g-" + topic
	const n, dups = 3000, 600

	msgs := events("b", 0, n, 30)
	var poison []kafka.Message
	for i, at := range []int{100, 1500, 2900} {
		p := kafkainbox.NewMessage("poison-"+string(rune('a'+i)), msgs[at].Key, []byte("bad"))
		poison = append(poison, p)
		msgs = append(msgs[:at:at], append([]kafka.Message{p}, msgs[at:]...)...)
	}
	publish(t, brokers, topic, msgs...)
	again := make([]kafka.Message, 0, dups)
	for i := 0; i < dups; i++ {
		again = append(again, events("b", i*5, i*5+1, 30)...)
	}
	publish(t, brokers, topic, again...)

	var (
		dupRuns atomic.Int64 // handler runs for an ID whose effect had committed
		mu      sync.Mutex
		lastTx  pgx.Tx
		streak  int
		longest int // most handler calls in one transaction
	)
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		if tx == lastTx {
			streak++
		} else {
			lastTx, streak = tx, 1
		}
		longest = max(longest, streak)
		mu.Unlock()
		if strings.HasPrefix(m.ID, "poison-") {
			return errors.New("bad payload")
		}
		var done bool
		if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM effects WHERE event_id = $1)`, m.ID).Scan(&done); err != nil {
			return err
		}
		if done {
			dupRuns.Add(1)
		}
		return fx.insert(ctx, tx, m)
	}
	cfg := kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: fx.processor(), BatchSize: 100}

	// First run, stopped gracefully mid-stream.
	stop := start(t, cfg, handler)
	testsvc.Eventually(t, 60*time.Second, func() bool { return fx.effects(t) >= n/3 }, "first run progresses")
	stop()
	require.Less(t, fx.effects(t), n, "stopped mid-stream")

	// Second run, two batches at a time, to the end.
	cfg.Concurrency = 2
	stop = start(t, cfg, handler)
	testsvc.Eventually(t, 90*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(DISTINCT event_id) FROM effects`) >= n
	}, "everything processed")
	waitNoLag(t, brokers, group, topic)
	stop()

	fx.assertExactlyOnce(t, n)
	require.Zero(t, dupRuns.Load(), "the handler ran for an event already done")
	require.Greater(t, longest, 10, "messages ran in shared transactions (batches)")
	require.GreaterOrEqual(t, fx.dups.Load(), int64(dups), "duplicates answered")

	dl := readAll(t, brokers, topic+kafkainbox.DeadLetterSuffix)
	require.Len(t, dl, len(poison))
	for _, d := range dl {
		h := map[string]string{}
		for _, hd := range d.Headers {
			h[hd.Key] = string(hd.Value)
		}
		require.True(t, strings.HasPrefix(h[consumer.HeaderDLID], "poison-"))
		require.Equal(t, "3", h[consumer.HeaderDLAttempts])
		require.Contains(t, h[consumer.HeaderDLError], "bad payload")
	}
	require.Equal(t, len(poison), fx.pg.Count(t, `SELECT count(*) FROM processed_events WHERE status = 'failed'`))
}
