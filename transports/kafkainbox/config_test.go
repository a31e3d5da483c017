package kafkainbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

func TestConfig(t *testing.T) {
	// A pool that is never used: New does not connect.
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	valid := kafkainbox.Config{
		Brokers:   []string{"127.0.0.1:9092"},
		Topic:     "orders",
		GroupID:   "billing",
		Processor: consumer.Config{Ledger: ledger},
	}
	require.NoError(t, valid.Validate())

	for name, mutate := range map[string]func(*kafkainbox.Config){
		"no brokers":        func(c *kafkainbox.Config) { c.Brokers = nil },
		"empty broker":      func(c *kafkainbox.Config) { c.Brokers = []string{""} },
		"no topic":          func(c *kafkainbox.Config) { c.Topic = "" },
		"no group":          func(c *kafkainbox.Config) { c.GroupID = "" },
		"no ledger":         func(c *kafkainbox.Config) { c.Processor.Ledger = nil },
		"negative workers":  func(c *kafkainbox.Config) { c.Concurrency = -1 },
		"bad ordering":      func(c *kafkainbox.Config) { c.Ordering = 9 },
		"negative batch":    func(c *kafkainbox.Config) { c.BatchSize = -1 },
		"negative buffer":   func(c *kafkainbox.Config) { c.MaxBuffered = -1 },
		"negative interval": func(c *kafkainbox.Config) { c.CommitInterval = -1 },
		"dlq is the topic":  func(c *kafkainbox.Config) { c.DeadLetterTopic = "orders" },
		"writer with topic": func(c *kafkainbox.Config) {
			c.DeadLetterWriter = &kafka.Writer{Topic: "x", RequiredAcks: kafka.RequireAll}
		},
		"writer without acks": func(c *kafkainbox.Config) { c.DeadLetterWriter = &kafka.Writer{} },
		"async writer": func(c *kafkainbox.Config) {
			c.DeadLetterWriter = &kafka.Writer{RequiredAcks: kafka.RequireAll, Async: true}
		},
	} {
		cfg := valid
		mutate(&cfg)
		err := cfg.Validate()
		require.ErrorIs(t, err, inbox.ErrConfig, name)
		_, err = kafkainbox.New(cfg, func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
		require.ErrorIs(t, err, inbox.ErrConfig, name)
	}

	c, err := kafkainbox.New(valid, func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	require.NoError(t, err)
	got := c.Config()
	require.Equal(t, "billing", got.Processor.Scope, "scope defaults to the group")
	require.Equal(t, kafkainbox.Source, got.Processor.Source)
	require.Equal(t, "orders.dlq", got.DeadLetterTopic)
	require.NotNil(t, got.Processor.DeadLetter)
	require.Equal(t, consumer.DefaultConcurrency, got.Concurrency)
	require.Equal(t, kafkainbox.DefaultCommitInterval, got.CommitInterval)
	require.Equal(t, consumer.DefaultShutdownTimeout, got.ShutdownTimeout)
	require.Equal(t, consumer.DefaultMaxBuffered, got.MaxBuffered)
	id, err := got.Processor.ID(&consumer.Message{Headers: []consumer.Header{{Key: "ce_id", Value: []byte("x")}}})
	require.NoError(t, err)
	require.Equal(t, "x", id, "CloudEvents ce_id by default")

	// The group timings given to kafka-go, seen by Config.Reader.
	var rc kafka.ReaderConfig
	withReader := valid
	withReader.Reader = func(r *kafka.ReaderConfig) { rc = *r }
	c2, err := kafkainbox.New(withReader, func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, c2.Run(ctx))
	require.Equal(t, kafkainbox.DefaultSessionTimeout, rc.SessionTimeout)
	require.Equal(t, kafkainbox.DefaultRebalanceTimeout, rc.RebalanceTimeout)
	require.Equal(t, kafkainbox.DefaultHeartbeatInterval, rc.HeartbeatInterval)
	require.Equal(t, kafkainbox.DefaultJoinGroupBackoff, rc.JoinGroupBackoff)
	require.LessOrEqual(t, 3*rc.HeartbeatInterval, rc.SessionTimeout, "heartbeat within a third of the session")
	require.GreaterOrEqual(t, rc.SessionTimeout, 6*time.Second, "within the brokers' default group.min.session.timeout.ms")

	// Run once.
	require.NoError(t, c.Run(ctx))
	require.ErrorIs(t, c.Run(ctx), consumer.ErrRunOnce)
}
