package outbox_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
)

// Two relays on one outbox while writers keep adding: every message is
// published exactly once, each key's messages in the order they were
// added, and both relays published, some lanes by turns.
func TestConcurrentRelaysOrderNoDuplicates(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 8)
	ns := newNATS(t)
	topic := newTopic(t, fx.brokers, 4)
	subject := testsvc.Unique("evts")
	stream, err := ns.js.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "S-" + subject, Subjects: []string{subject + ".>"}, Storage: jetstream.FileStorage, Duplicates: time.Minute,
	})
	require.NoError(t, err)

	const keys, perKey = 24, 60
	var mu sync.Mutex
	byRelay := map[int]int{}
	lanesOf := map[int]map[int]bool{0: {}, 1: {}}
	for i := range 2 {
		fx.relay(t, outbox.RelayConfig{
			Publishers:   publishers(fx.kafka(t), ns.publisher(t)),
			BatchSize:    20, // many batches: the relays meet on lanes
			Concurrency:  2,
			PollInterval: 50 * time.Millisecond,
			Hooks: outbox.RelayHooks{OnPublished: func(_ outbox.Broker, lane, n int) {
				mu.Lock()
				byRelay[i] += n
				lanesOf[i][lane] = true
				mu.Unlock()
			}},
		})
	}
	// Writers: each transaction adds the next message of a few keys, on
	// both brokers; four writers at once, each owning its keys.
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perKey {
				err := pgx.BeginFunc(context.Background(), fx.pg.Pool, func(tx pgx.Tx) error {
					var msgs []outbox.Message
					for k := w; k < keys; k += 4 {
						key := "key-" + strconv.Itoa(k)
						v := []byte(strconv.Itoa(i))
						msgs = append(msgs,
							outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte(key), Value: v},
							outbox.Message{Broker: outbox.NATS, Topic: subject + "." + key, Key: []byte(key), Value: v})
					}
					_, err := fx.ob.Add(context.Background(), tx, msgs...)
					return err
				})
				if err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	fx.waitDrained(t, 120*time.Second)

	// Kafka: per key, 0..perKey-1 once each, in order.
	got := map[string][]int{}
	ids := map[string]bool{}
	for _, m := range allMessages(readTopic(t, fx.brokers, topic)) {
		id := header(m, "ce_id")
		require.False(t, ids[id], "Kafka: %s published twice", id)
		ids[id] = true
		v, _ := strconv.Atoi(string(m.Value))
		got[string(m.Key)] = append(got[string(m.Key)], v)
	}
	require.Len(t, got, keys)
	for k, vs := range got {
		require.Len(t, vs, perKey, "Kafka key %s", k)
		for i, v := range vs {
			require.Equal(t, i, v, "Kafka key %s out of order: %v", k, vs)
		}
	}
	// NATS: the same, per subject, and no message deduplicated by the
	// stream (every publish was a first).
	got = map[string][]int{}
	for _, m := range ns.streamMessages(t, stream) {
		id := m.Header.Get("Nats-Msg-Id")
		require.False(t, ids[id], "NATS: %s published twice", id)
		ids[id] = true
		v, _ := strconv.Atoi(string(m.Data))
		got[m.Subject] = append(got[m.Subject], v)
	}
	require.Len(t, got, keys)
	for s, vs := range got {
		require.Len(t, vs, perKey, "NATS subject %s", s)
		for i, v := range vs {
			require.Equal(t, i, v, "NATS subject %s out of order: %v", s, vs)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, 2*keys*perKey, byRelay[0]+byRelay[1])
	require.Positive(t, byRelay[0], "relay 0 published")
	require.Positive(t, byRelay[1], "relay 1 published")
	shared := 0
	for l := range lanesOf[0] {
		if lanesOf[1][l] {
			shared++
		}
	}
	require.Positive(t, shared, "some lane was published by both relays, by turns")
	t.Logf("relay 0 published %d, relay 1 %d; %d of 8 lanes published by both", byRelay[0], byRelay[1], shared)
}

// Messages the broker refuses for good are marked failed with the error,
// the rest of the queue (their lane included) is published, and Retry
// puts them back: an unknown topic (the relay never has the broker create
// it), a message over the broker's size limit, a NATS subject no stream
// takes.
func TestPermanentFailures(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 1) // one lane: the failures sit in the way of the rest
	ns := newNATS(t)
	topic := newTopic(t, fx.brokers, 1)
	missing := testsvc.Unique("missing")
	subject := testsvc.Unique("ok")
	stream := ns.stream(t, subject, time.Minute)
	noStream := testsvc.Unique("nostream")

	big := make([]byte, 2<<20) // over the broker's message.max.bytes (1 MiB)
	ids := fx.add(t,
		outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte("0")},
		outbox.Message{Broker: outbox.Kafka, Topic: missing, Key: []byte("k"), Value: []byte("lost topic")},
		outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: big},
		outbox.Message{Broker: outbox.NATS, Topic: noStream, Value: []byte("no stream")},
		outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte("1")},
		outbox.Message{Broker: outbox.NATS, Topic: subject, Value: []byte("2")})

	var mu sync.Mutex
	var failed []*outbox.PublishError
	w := fx.writer(t)
	w.BatchBytes = 4 << 20 // the broker, not kafka-go, refuses the big one
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(kafkaOn(t, w), ns.publisher(t)), Hooks: outbox.RelayHooks{
		OnFailed: func(err *outbox.PublishError) { mu.Lock(); failed = append(failed, err); mu.Unlock() },
	}})
	fx.waitDrained(t, 60*time.Second)

	msgs := allMessages(readTopic(t, fx.brokers, topic))
	require.Len(t, msgs, 2)
	require.Equal(t, "0", string(msgs[0].Value))
	require.Equal(t, "1", string(msgs[1].Value), "a later message of the key overtakes the failed one")
	require.Len(t, ns.streamMessages(t, stream), 1)
	require.False(t, topicExists(t, fx.brokers, missing), "the relay did not have the topic created")

	st, err := fx.ob.Stats(context.Background())
	require.NoError(t, err)
	require.Equal(t, int64(3), st.Failed)
	rows, err := fx.pg.Pool.Query(context.Background(), `SELECT id, error FROM outbox WHERE status = 'failed' ORDER BY seq`)
	require.NoError(t, err)
	type row struct {
		ID    string
		Error string
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	require.NoError(t, err)
	require.Len(t, got, 3)
	require.Equal(t, []string{ids[1], ids[2], ids[3]}, []string{got[0].ID, got[1].ID, got[2].ID})
	require.Contains(t, strings.ToLower(got[0].Error), "unknown topic")
	require.Contains(t, strings.ToLower(got[1].Error), "too large")
	require.Contains(t, strings.ToLower(got[2].Error), "no response from stream")
	mu.Lock()
	require.Len(t, failed, 3)
	for _, f := range failed {
		require.ErrorIs(t, f, outbox.ErrPermanent)
		require.True(t, f.Permanent)
	}
	mu.Unlock()

	// Fix the cause of one, retry it: it is published.
	_, err = ns.js.CreateStream(context.Background(), jetstreamConfig(noStream))
	require.NoError(t, err)
	n, err := fx.ob.Retry(context.Background(), ids[3])
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	testsvc.Eventually(t, 30*time.Second, func() bool {
		st, err := fx.ob.Stats(context.Background())
		require.NoError(t, err)
		return st.Failed == 2 && st.Pending == 0
	}, "retried message published")
}

// A relay wakes on the commit's notification: with a poll interval of an
// hour, messages committed after the relay went idle are still published.
func TestNotifyWakesRelay(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 4)
	topic := newTopic(t, fx.brokers, 1)
	var published atomic.Int64
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(fx.kafka(t), nil), PollInterval: time.Hour, Hooks: outbox.RelayHooks{
		OnPublished: func(_ outbox.Broker, _, n int) { published.Add(int64(n)) },
	}})
	// The relay's first look (at start) found nothing; it waits now.
	testsvc.Eventually(t, 30*time.Second, func() bool {
		return listening(t, fx)
	}, "relay listening")
	for i := range 5 {
		fx.add(t, outbox.Message{Broker: outbox.Kafka, Topic: topic, Value: []byte(strconv.Itoa(i))})
		testsvc.Eventually(t, 30*time.Second, func() bool { return published.Load() == int64(i+1) }, "message %d published", i)
	}
	require.Len(t, allMessages(readTopic(t, fx.brokers, topic)), 5)
}

// listening reports whether a session of the test's schema is waiting on
// the outbox channel.
func listening(t testing.TB, fx *fixture) bool {
	return fx.pg.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %'`, fx.pg.Schema) > 0
}

// Run runs once; a stopped relay returns nil; a relay needs a publisher,
// of a broker Add knows.
func TestRelayContract(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 0)
	for name, ps := range map[string]map[outbox.Broker]outbox.Publisher{
		"none":           nil,
		"nil publisher":  {outbox.Kafka: nil},
		"unknown broker": {"rabbit": fx.kafka(t)},
	} {
		_, err := fx.ob.Relay(outbox.RelayConfig{Publishers: ps})
		require.ErrorIs(t, err, inbox.ErrConfig, name)
	}

	ps := publishers(fx.kafka(t), nil)
	r, err := fx.ob.Relay(outbox.RelayConfig{Publishers: ps})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	testsvc.Eventually(t, 30*time.Second, func() bool { return listening(t, fx) }, "running")
	require.ErrorIs(t, r.Run(context.Background()), consumer.ErrRunOnce)
	cancel()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
}

// A broker that fails for the time being keeps the lane's order: the
// relay backs off and publishes everything, in order, once it is back.
func TestTransientFailureKeepsOrder(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 1)
	topic := newTopic(t, fx.brokers, 1)
	proxy := testsvc.Proxy(t, fx.brokers[0])
	proxy.Refuse(true)
	w := &kafka.Writer{Addr: kafka.TCP(proxy.Addr()), MaxAttempts: 1}
	t.Cleanup(func() { _ = w.Close() })
	var retries atomic.Int64
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(kafkaOn(t, w), nil), PublishTimeout: 2 * time.Second,
		Backoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 100 * time.Millisecond},
		Hooks:   outbox.RelayHooks{OnRetry: func(*outbox.PublishError) { retries.Add(1) }}})
	for i := range 20 {
		fx.add(t, outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte(strconv.Itoa(i))})
	}
	testsvc.Eventually(t, 30*time.Second, func() bool { return retries.Load() >= 3 }, "relay retrying")
	proxy.Refuse(false)
	fx.waitDrained(t, 60*time.Second)
	msgs := allMessages(readTopic(t, fx.brokers, topic))
	var vs []string
	for _, m := range msgs {
		vs = append(vs, string(m.Value))
	}
	want := make([]string, 20)
	for i := range want {
		want[i] = fmt.Sprint(i)
	}
	require.Equal(t, want, vs)
}

// A Kafka-only relay and a NATS-only relay on one outbox, sharing its
// only lane: each publishes its broker's messages, neither retries the
// other's.
func TestRelaysPerBroker(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 1)
	ns := newNATS(t)
	topic := newTopic(t, fx.brokers, 1)
	subject := testsvc.Unique("per")
	stream := ns.stream(t, subject, time.Minute)
	// A retry of a message of the relay's own broker may happen (a topic
	// just created can be unknown to the broker for a moment); of the
	// other broker's, never.
	var foreign atomic.Int64
	only := func(b outbox.Broker) outbox.RelayHooks {
		return outbox.RelayHooks{
			OnRetry: func(e *outbox.PublishError) {
				if e.Broker != b {
					foreign.Add(1)
				}
			},
			OnPublished: func(got outbox.Broker, _, _ int) {
				if got != b {
					foreign.Add(1)
				}
			},
		}
	}
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(fx.kafka(t), nil), Hooks: only(outbox.Kafka)})
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(nil, ns.publisher(t)), Hooks: only(outbox.NATS)})
	for i := range 20 {
		v := []byte(strconv.Itoa(i))
		fx.add(t, outbox.Message{Broker: outbox.Kafka, Topic: topic, Value: v}, outbox.Message{Broker: outbox.NATS, Topic: subject, Value: v})
	}
	fx.waitDrained(t, 60*time.Second)
	require.Len(t, allMessages(readTopic(t, fx.brokers, topic)), 20)
	require.Len(t, ns.streamMessages(t, stream), 20)
	require.Zero(t, foreign.Load(), "a relay touched the other broker's messages")
}

// A relay leaves alone a lane whose lock another relay holds (it reads
// the lane along with its try for the lock, and drops what it read), ends
// each such transaction, and publishes the lane once the lock is free.
func TestRelaySkipsALaneAnotherHolds(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 1)
	topic := newTopic(t, fx.brokers, 1)
	ctx := context.Background()
	holder, err := fx.pg.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	var holderPID int
	require.NoError(t, holder.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holderPID))
	_, err = holder.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('justonce.outbox:' || $1::text || ':0', 0))`, fx.pg.Schema)
	require.NoError(t, err)

	for i := range 3 {
		fx.add(t, outbox.Message{Broker: outbox.Kafka, Topic: topic, Key: []byte("k"), Value: []byte(strconv.Itoa(i))})
	}
	var published atomic.Int64
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(fx.kafka(t), nil), PollInterval: 20 * time.Millisecond, Hooks: outbox.RelayHooks{
		OnPublished: func(_ outbox.Broker, _, n int) { published.Add(int64(n)) },
	}})
	testsvc.Eventually(t, 30*time.Second, func() bool {
		return fx.pg.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND pid <> $2
			AND query = 'ROLLBACK' AND state = 'idle'`, fx.pg.Schema, holderPID) > 0
	}, "the relay tried the held lane and ended its transaction")
	require.Zero(t, published.Load(), "published from a lane another relay holds")
	st, err := fx.ob.Stats(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 3, st.Pending)
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND pid <> $2 AND state LIKE 'idle in transaction%'`, fx.pg.Schema, holderPID),
		"a relay left its transaction open")

	require.NoError(t, holder.Rollback(ctx))
	testsvc.Eventually(t, 30*time.Second, func() bool { return published.Load() == 3 }, "lane published once free")
	msgs := allMessages(readTopic(t, fx.brokers, topic))
	require.Len(t, msgs, 3)
	for i, m := range msgs {
		require.Equal(t, strconv.Itoa(i), string(m.Value))
	}
}
