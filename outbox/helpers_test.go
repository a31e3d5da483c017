package outbox_test

import (
	"context"
	"errors"
	"net"
	"sort"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/kafkainbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

// fixture is one test's schema, outbox and brokers.
type fixture struct {
	pg      *testsvc.PG
	ob      *outbox.Outbox
	brokers []string
}

func newFixture(t testing.TB, lanes int) *fixture {
	t.Helper()
	pg := testsvc.Postgres(t, testsvc.MaxConns(16))
	ob, err := outbox.New(pg.Pool, outbox.Config{Schema: pg.Schema, Lanes: lanes})
	require.NoError(t, err)
	return &fixture{pg: pg, ob: ob, brokers: testsvc.KafkaBrokers(t)}
}

// add adds msgs in a transaction of their own and returns their IDs.
func (fx *fixture) add(t testing.TB, msgs ...outbox.Message) []string {
	t.Helper()
	var ids []string
	err := pgx.BeginFunc(context.Background(), fx.pg.Pool, func(tx pgx.Tx) error {
		var err error
		ids, err = fx.ob.Add(context.Background(), tx, msgs...)
		return err
	})
	require.NoError(t, err)
	return ids
}

// writer is a kafka-go writer for a relay's publisher.
func (fx *fixture) writer(t testing.TB) *kafka.Writer {
	w := &kafka.Writer{Addr: kafka.TCP(fx.brokers...)}
	t.Cleanup(func() { _ = w.Close() })
	return w
}

// kafka is a kafka-go publisher on a writer of its own.
func (fx *fixture) kafka(t testing.TB) outbox.Publisher {
	return kafkaOn(t, fx.writer(t))
}

// kafkaOn is a kafka-go publisher on w.
func kafkaOn(t testing.TB, w *kafka.Writer) outbox.Publisher {
	t.Helper()
	p, err := kafkainbox.NewOutboxPublisher(w)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// publishers is RelayConfig.Publishers with a Kafka and a NATS
// publisher, either of which may be nil.
func publishers(kafka, nats outbox.Publisher) map[outbox.Broker]outbox.Publisher {
	m := map[outbox.Broker]outbox.Publisher{}
	if kafka != nil {
		m[outbox.Kafka] = kafka
	}
	if nats != nil {
		m[outbox.NATS] = nats
	}
	return m
}

// relay starts a relay and stops it when the test ends.
func (fx *fixture) relay(t testing.TB, cfg outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	r, err := fx.ob.Relay(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop")
		}
	})
	return r
}

// waitDrained waits until the outbox has no pending message.
func (fx *fixture) waitDrained(t testing.TB, deadline time.Duration) {
	t.Helper()
	testsvc.Eventually(t, deadline, func() bool {
		st, err := fx.ob.Stats(context.Background())
		require.NoError(t, err)
		return st.Pending == 0
	}, "outbox drained")
}

// newTopic creates a topic with the given partitions.
func newTopic(t testing.TB, brokers []string, partitions int) string {
	t.Helper()
	name := testsvc.Unique("ob")
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	ctrl, err := conn.Controller()
	require.NoError(t, err)
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	require.NoError(t, err)
	defer cc.Close()
	require.NoError(t, cc.CreateTopics(kafka.TopicConfig{Topic: name, NumPartitions: partitions, ReplicationFactor: 1}))
	testsvc.Eventually(t, 30*time.Second, func() bool {
		ps, err := conn.ReadPartitions(name)
		return err == nil && len(ps) == partitions
	}, "topic %s created", name)
	return name
}

// topicExists asks the broker's metadata without creating the topic.
func topicExists(t testing.TB, brokers []string, topic string) bool {
	t.Helper()
	c := &kafka.Client{Addr: kafka.TCP(brokers...)}
	md, err := c.Metadata(context.Background(), &kafka.MetadataRequest{Topics: []string{topic}})
	require.NoError(t, err)
	for _, tp := range md.Topics {
		if tp.Name == topic {
			return tp.Error == nil
		}
	}
	return false
}

// readTopic reads every message of topic up to each partition's high
// watermark at the call, partition by partition in offset order.
func readTopic(t testing.TB, brokers []string, topic string) map[int][]kafka.Message {
	t.Helper()
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	parts, err := conn.ReadPartitions(topic)
	require.NoError(t, err)
	out := map[int][]kafka.Message{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, p := range parts {
		wg.Add(1)
		go func(p int) {
			defer wg.Done()
			lc, err := kafka.DialLeader(context.Background(), "tcp", brokers[0], topic, p)
			if err != nil {
				t.Errorf("dial leader: %v", err)
				return
			}
			hwm, err := lc.ReadLastOffset()
			_ = lc.Close()
			if err != nil {
				t.Errorf("last offset: %v", err)
				return
			}
			if hwm == 0 {
				return
			}
			r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: p, MaxWait: 100 * time.Millisecond})
			defer r.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			var ms []kafka.Message
			for {
				m, err := r.ReadMessage(ctx)
				if err != nil {
					t.Errorf("read %s/%d: %v", topic, p, err)
					return
				}
				ms = append(ms, m)
				if m.Offset >= hwm-1 {
					break
				}
			}
			mu.Lock()
			out[p] = ms
			mu.Unlock()
		}(p.ID)
	}
	wg.Wait()
	return out
}

// allMessages flattens readTopic's answer.
func allMessages(byPart map[int][]kafka.Message) []kafka.Message {
	var ps []int
	for p := range byPart {
		ps = append(ps, p)
	}
	sort.Ints(ps)
	var out []kafka.Message
	for _, p := range ps {
		out = append(out, byPart[p]...)
	}
	return out
}

func header(m kafka.Message, k string) string {
	for _, h := range m.Headers {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}

// natsEnv is an embedded NATS server with JetStream and a connection.
type natsEnv struct {
	nc *nats.Conn
	js jetstream.JetStream
}

func newNATS(t testing.TB) *natsEnv {
	t.Helper()
	url := testsvc.NATSURL(t)
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return &natsEnv{nc: nc, js: js}
}

// publisher is a JetStream publisher on the connection.
func (e *natsEnv) publisher(t testing.TB) outbox.Publisher {
	return natsOn(t, e.js)
}

// natsOn is a JetStream publisher on js.
func natsOn(t testing.TB, js jetstream.JetStream) outbox.Publisher {
	t.Helper()
	p, err := natsinbox.NewOutboxPublisher(js)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// stream creates a stream on subject with the given duplicate window.
func (e *natsEnv) stream(t testing.TB, subject string, dup time.Duration) jetstream.Stream {
	t.Helper()
	s, err := e.js.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "S-" + subject, Subjects: []string{subject}, Storage: jetstream.FileStorage, Duplicates: dup,
	})
	require.NoError(t, err)
	return s
}

// streamMessages reads every message of the stream in order.
func (e *natsEnv) streamMessages(t testing.TB, s jetstream.Stream) []*jetstream.RawStreamMsg {
	t.Helper()
	info, err := s.Info(context.Background())
	require.NoError(t, err)
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(context.Background(), seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		require.NoError(t, err)
		out = append(out, m)
	}
	return out
}

func jetstreamConfig(subject string) jetstream.StreamConfig {
	return jetstream.StreamConfig{Name: "S-" + subject, Subjects: []string{subject}, Storage: jetstream.FileStorage}
}
