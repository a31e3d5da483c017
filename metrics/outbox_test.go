package metrics_test

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/metrics"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// The outbox collector against a real outbox and a relay to a real Kafka:
// the backlog and its age while no relay runs, then the relay's counters
// (published, failed for good) and an empty backlog.
func TestOutboxCollector(t *testing.T) {
	t.Parallel()
	pg := testsvc.Postgres(t, testsvc.MaxConns(12))
	brokers := testsvc.KafkaBrokers(t)
	ob, err := outbox.New(pg.Pool, outbox.Config{Schema: pg.Schema})
	require.NoError(t, err)
	c := metrics.NewOutboxCollector(ob, metrics.OutboxConfig{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)

	s := only(samples(t, reg), "justonce_outbox")
	require.Equal(t, map[string]float64{"justonce_outbox_pending": 0, "justonce_outbox_oldest_pending_age_seconds": 0,
		"justonce_outbox_failed": 0, "justonce_outbox_stats_up": 1}, s)

	topic := testsvc.Unique("m")
	conn, err := kafka.Dial("tcp", brokers[0])
	require.NoError(t, err)
	defer conn.Close()
	ctrl, err := conn.Controller()
	require.NoError(t, err)
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	require.NoError(t, err)
	defer cc.Close()
	require.NoError(t, cc.CreateTopics(kafka.TopicConfig{Topic: topic, NumPartitions: 1, ReplicationFactor: 1}))

	require.NoError(t, pgx.BeginFunc(context.Background(), pg.Pool, func(tx pgx.Tx) error {
		_, err := ob.Add(context.Background(), tx,
			outbox.Message{Broker: outbox.Kafka, Topic: topic, Value: []byte("1")},
			outbox.Message{Broker: outbox.Kafka, Topic: topic, Value: []byte("2")},
			outbox.Message{Broker: outbox.Kafka, Topic: topic, Value: make([]byte, 2<<20)}) // over the broker's limit
		return err
	}))
	testsvc.Eventually(t, 10*time.Second, func() bool {
		return samples(t, reg)["justonce_outbox_oldest_pending_age_seconds"] > 0
	}, "the backlog ages")
	require.Equal(t, 3.0, samples(t, reg)["justonce_outbox_pending"])

	w := &kafka.Writer{Addr: kafka.TCP(brokers...), BatchBytes: 4 << 20}
	defer w.Close()
	pub, err := kafkainbox.NewOutboxPublisher(w)
	require.NoError(t, err)
	r, err := ob.Relay(outbox.RelayConfig{Publishers: map[outbox.Broker]outbox.Publisher{outbox.Kafka: pub}, Hooks: c.Hooks()})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() { cancel(); require.NoError(t, <-done) }()
	// The hooks run after the relay's commit: wait for them too.
	testsvc.Eventually(t, 60*time.Second, func() bool {
		s := samples(t, reg)
		return s["justonce_outbox_pending"] == 0 && s[`justonce_outbox_published_total{broker="kafka"}`] == 2 &&
			s[`justonce_outbox_failed_total{broker="kafka"}`] == 1
	}, "relay drained the outbox")
	s = only(samples(t, reg), "justonce_outbox")
	require.Equal(t, 2.0, s[`justonce_outbox_published_total{broker="kafka"}`])
	require.Equal(t, 1.0, s[`justonce_outbox_failed_total{broker="kafka"}`])
	require.Equal(t, 1.0, s["justonce_outbox_failed"])
	require.Zero(t, s["justonce_outbox_oldest_pending_age_seconds"])
}
