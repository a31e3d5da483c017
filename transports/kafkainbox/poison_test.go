package kafkainbox_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// A poison message is retried in place MaxAttempts times, reaches the
// dead-letter topic with its headers, is recorded failed, and the messages
// behind it in its partition run after it, in order.
func TestPoisonMessageDeadLetteredAndPartitionFlows(t *testing.T) {
	t.Parallel()
	brokers := testsvc.KafkaBrokers(t)
	fx := newFixture(t)
	topic := newTopic(t, brokers, 2)
	group := "g-" + topic

	hot := []byte("hot") // one key: one partition, poison in the middle
	var msgs []kafka.Message
	for i := 0; i < 10; i++ {
		msgs = append(msgs, kafkainbox.NewMessage("hot-"+strconv.Itoa(i), hot, []byte("ok")))
	}
	poison := kafkainbox.NewMessage("poison", hot, []byte("bad payload"))
	poison.Headers = append(poison.Headers, kafka.Header{Key: "trace", Value: []byte("t-1")})
	msgs = append(msgs, poison)
	for i := 10; i < 20; i++ {
		msgs = append(msgs, kafkainbox.NewMessage("hot-"+strconv.Itoa(i), hot, []byte("ok")))
	}
	msgs = append(msgs, events("cold", 0, 20, 5)...)
	publish(t, brokers, topic, msgs...)

	var (
		mu         sync.Mutex
		poisonAt   = map[int]int64{} // attempt -> offset
		poisonPart = -1
		deadAt     time.Time
		firstAfter time.Time // when hot-10, behind the poison, ran
	)
	pc := fx.processor()
	pc.MaxAttempts = 4
	pc.Hooks.OnDeadLetter = func(m *consumer.Message, _ error) {
		mu.Lock()
		defer mu.Unlock()
		deadAt = time.Now()
	}
	stop := start(t, kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: pc},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			mu.Lock()
			switch m.ID {
			case "poison":
				poisonAt[m.Attempt] = m.Offset
				poisonPart = m.Partition
				mu.Unlock()
				return errors.New("boom: cannot parse payload")
			case "hot-10":
				firstAfter = time.Now()
			}
			mu.Unlock()
			return fx.insert(ctx, tx, m)
		})
	var dl []kafka.Message
	testsvc.Eventually(t, 60*time.Second, func() bool {
		if fx.effects(t) < 40 {
			return false
		}
		dl = readAll(t, brokers, topic+kafkainbox.DeadLetterSuffix)
		return len(dl) >= 1
	}, "good messages run and the poison is dead-lettered")
	stop()

	fx.assertExactlyOnce(t, 40)
	requireNoLag(t, brokers, group, topic)

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, poisonAt, 4, "attempts 1..4, in place")
	require.False(t, firstAfter.Before(deadAt), "hot-10 ran before the poison ahead of it was dead-lettered")

	// The dead letter: the original key, value and headers, then ours.
	require.Len(t, dl, 1)
	d := dl[0]
	require.Equal(t, "hot", string(d.Key))
	require.Equal(t, "bad payload", string(d.Value))
	h := map[string]string{}
	for _, hd := range d.Headers {
		h[hd.Key] = string(hd.Value)
	}
	require.Equal(t, "poison", h[kafkainbox.HeaderEventID])
	require.Equal(t, "t-1", h["trace"])
	require.Contains(t, h[consumer.HeaderDLError], "boom: cannot parse payload")
	require.Equal(t, "4", h[consumer.HeaderDLAttempts])
	require.Equal(t, topic, h[consumer.HeaderDLOrigin])
	require.Equal(t, strconv.Itoa(poisonPart), h[consumer.HeaderDLPartition])
	require.Equal(t, strconv.FormatInt(poisonAt[1], 10), h[consumer.HeaderDLOffset])
	require.Equal(t, "poison", h[consumer.HeaderDLID])
	require.Equal(t, group, h[consumer.HeaderDLScope], "the scope defaults to the group")
	_, err := time.Parse(time.RFC3339Nano, h[consumer.HeaderDLTime])
	require.NoError(t, err)

	rec, err := fx.ledger.Lookup(context.Background(), inbox.Key{Scope: group, ID: "poison"})
	require.NoError(t, err)
	require.Equal(t, inbox.StatusFailed, rec.Status)
	require.Equal(t, kafkainbox.Source, rec.Source)

	// Order within the hot partition: effects in offset order.
	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT off FROM effects WHERE event_id LIKE 'hot-%' ORDER BY n`)
	require.NoError(t, err)
	offs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Len(t, offs, 20)
	for i := 1; i < len(offs); i++ {
		require.Greater(t, offs[i], offs[i-1], "partition order kept")
	}
}
