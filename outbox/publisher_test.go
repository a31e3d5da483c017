package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/outboxtest"
	"github.com/justonce/justonce/outbox"
)

// The outbox package links no broker client: the publishers live beside
// their clients' fronts (transports/...), so a program links only the
// client it uses.
func TestOutboxLinksNoBrokerClient(t *testing.T) {
	outboxtest.LinksNone(t, "github.com/segmentio/", "github.com/twmb/franz-go", "github.com/nats-io/")
}

// scripted is a Publisher that answers each message as answer says, and
// records what it was handed. Like a broker, it answers every message
// after one that failed for the time being with the same failure.
type scripted struct {
	answer func(m outbox.Message, attempt int) error

	mu       sync.Mutex
	offered  map[string]int // attempts per ID
	batches  [][]outbox.Message
	acked    []string // IDs, in order
	closed   bool
	inFlight atomic.Int32
	overlap  atomic.Bool // two Publish calls at once
}

func newScripted(answer func(outbox.Message, int) error) *scripted {
	return &scripted{answer: answer, offered: map[string]int{}}
}

func (s *scripted) Publish(_ context.Context, msgs []outbox.Message) []error {
	if s.inFlight.Add(1) > 1 {
		s.overlap.Store(true)
	}
	defer s.inFlight.Add(-1)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.batches = append(s.batches, msgs)
	var errs []error
	var stopped error
	for i, m := range msgs {
		s.offered[m.ID]++
		err := stopped
		if err == nil {
			err = s.answer(m, s.offered[m.ID])
			if err != nil && !errors.Is(err, outbox.ErrPermanent) {
				stopped = err
			}
		}
		if err == nil {
			s.acked = append(s.acked, m.ID)
			continue
		}
		if errs == nil {
			errs = make([]error, len(msgs))
		}
		errs[i] = err
	}
	return errs
}

func (s *scripted) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	return nil
}

func (s *scripted) ackedIDs() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.acked...)
}

var errTooLarge = errors.New("message too large")

// The relay over a Publisher of its own, with both brokers in one lane:
// each publisher is handed only its broker's messages, in lane order, with
// their IDs, keys, headers and values; a refusal wrapped in
// outbox.Permanent is marked failed with the error's text (the hooks see
// it permanent, matching the publisher's error); a failure for the time
// being is retried with backoff, and the lane goes on in order; a nil
// answer publishes the whole batch. The relay does not close publishers.
func TestRelayOverAPublisher(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 1)
	var transient atomic.Int64
	kafkaPub := newScripted(func(m outbox.Message, attempt int) error {
		switch string(m.Value) {
		case "2":
			return outbox.Permanent(fmt.Errorf("broker says: %w", errTooLarge))
		case "5":
			if attempt <= 2 {
				transient.Add(1)
				return errors.New("leader not available")
			}
		}
		return nil
	})
	natsPub := newScripted(func(outbox.Message, int) error { return nil })
	var mu sync.Mutex
	var failed, retried []*outbox.PublishError
	published := map[outbox.Broker]int{}
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(kafkaPub, natsPub), BatchSize: 4, PollInterval: 20 * time.Millisecond,
		Backoff: backoff.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		Hooks: outbox.RelayHooks{
			OnFailed:    func(e *outbox.PublishError) { mu.Lock(); failed = append(failed, e); mu.Unlock() },
			OnRetry:     func(e *outbox.PublishError) { mu.Lock(); retried = append(retried, e); mu.Unlock() },
			OnPublished: func(b outbox.Broker, _, n int) { mu.Lock(); published[b] += n; mu.Unlock() },
		}})
	hdr := []consumer.Header{{Key: "type", Value: []byte("order.created")}}
	var kafkaIDs, natsIDs []string
	for i := range 10 {
		v := []byte(strconv.Itoa(i))
		ids := fx.add(t,
			outbox.Message{Broker: outbox.Kafka, Topic: "orders", Key: []byte("k"), Headers: hdr, Value: v},
			outbox.Message{Broker: outbox.NATS, Topic: "orders.created", Key: []byte("k"), Value: v})
		kafkaIDs = append(kafkaIDs, ids[0])
		natsIDs = append(natsIDs, ids[1])
	}
	fx.waitDrained(t, 30*time.Second)

	want := append(append([]string(nil), kafkaIDs[:2]...), kafkaIDs[3:]...)
	require.Equal(t, want, kafkaPub.ackedIDs(), "every Kafka message once, in order, but the refused one")
	require.Equal(t, natsIDs, natsPub.ackedIDs())
	kafkaPub.mu.Lock()
	for _, b := range kafkaPub.batches {
		require.LessOrEqual(t, len(b), 4, "BatchSize")
		for _, m := range b {
			require.Equal(t, outbox.Kafka, m.Broker)
			require.Equal(t, "orders", m.Topic)
			require.Equal(t, "k", string(m.Key))
			require.Equal(t, hdr, m.Headers)
		}
	}
	kafkaPub.mu.Unlock()
	natsPub.mu.Lock()
	for _, b := range natsPub.batches {
		for _, m := range b {
			require.Equal(t, outbox.NATS, m.Broker)
			require.Empty(t, m.Headers)
		}
	}
	natsPub.mu.Unlock()
	require.EqualValues(t, 2, transient.Load())

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, failed, 1)
	require.Equal(t, kafkaIDs[2], failed[0].ID)
	require.True(t, failed[0].Permanent)
	require.ErrorIs(t, failed[0], outbox.ErrPermanent)
	require.ErrorIs(t, failed[0], errTooLarge)
	var stored string
	require.NoError(t, fx.pg.Pool.QueryRow(context.Background(), `SELECT error FROM outbox WHERE status = 'failed'`).Scan(&stored))
	require.Equal(t, "broker says: message too large", stored, "the publisher's error text")
	require.NotEmpty(t, retried)
	for _, r := range retried {
		require.False(t, r.Permanent)
		require.Equal(t, outbox.Kafka, r.Broker)
	}
	require.Equal(t, map[outbox.Broker]int{outbox.Kafka: 9, outbox.NATS: 10}, published)
	require.False(t, kafkaPub.closed || natsPub.closed, "the relay closed a publisher")
}

// A publisher that answers a batch with a result count other than the
// batch's has the whole batch retried; once it answers properly the lane
// is published in order.
func TestRelayPublisherAnswerCount(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 1)
	var calls atomic.Int64
	good := newScripted(func(outbox.Message, int) error { return nil })
	bad := &countingPublisher{Publisher: good, short: func() bool { return calls.Add(1) <= 2 }}
	var retries atomic.Int64
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(bad, nil), PollInterval: 20 * time.Millisecond,
		Backoff: backoff.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		Hooks:   outbox.RelayHooks{OnRetry: func(*outbox.PublishError) { retries.Add(1) }}})
	var ids []string
	for i := range 3 {
		ids = append(ids, fx.add(t, outbox.Message{Broker: outbox.Kafka, Topic: "t", Key: []byte("k"), Value: []byte(strconv.Itoa(i))})...)
	}
	fx.waitDrained(t, 30*time.Second)
	require.Equal(t, ids, good.ackedIDs()[len(good.ackedIDs())-3:], "the lane in order once answered properly")
	require.Positive(t, retries.Load())
	require.Zero(t, fx.pg.Count(t, `SELECT count(*) FROM outbox`))
}

// countingPublisher answers with one result too few while short says so.
type countingPublisher struct {
	outbox.Publisher
	short func() bool
}

func (p *countingPublisher) Publish(ctx context.Context, msgs []outbox.Message) []error {
	errs := p.Publisher.Publish(ctx, msgs)
	if p.short() {
		return make([]error, len(msgs)-1)
	}
	return errs
}

// The relay publishes a lane's batches one at a time: a publisher is never
// handed two batches of one lane at once.
func TestRelayOneBatchOfALaneAtATime(t *testing.T) {
	t.Parallel()
	fx := newFixture(t, 1)
	pub := newScripted(func(outbox.Message, int) error { time.Sleep(time.Millisecond); return nil })
	for range 2 {
		fx.relay(t, outbox.RelayConfig{Publishers: publishers(pub, nil), BatchSize: 5, PollInterval: 10 * time.Millisecond})
	}
	var ids []string
	for i := range 60 {
		ids = append(ids, fx.add(t, outbox.Message{Broker: outbox.Kafka, Topic: "t", Key: []byte("k"), Value: []byte(strconv.Itoa(i))})...)
	}
	fx.waitDrained(t, 30*time.Second)
	require.Equal(t, ids, pub.ackedIDs())
	require.False(t, pub.overlap.Load(), "two batches of the lane published at once")
}
