package franzinbox_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

func TestConfig(t *testing.T) {
	// A pool that is never used: New does not connect.
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	ledger, err := inbox.New(pool, inbox.Config{})
	require.NoError(t, err)
	valid := franzinbox.Config{
		Brokers:   []string{"127.0.0.1:1"},
		Topics:    []string{"orders"},
		GroupID:   "billing",
		Processor: consumer.Config{Ledger: ledger},
	}
	require.NoError(t, valid.Validate())
	nop := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }

	for name, mutate := range map[string]func(*franzinbox.Config){
		"no brokers":           func(c *franzinbox.Config) { c.Brokers = nil },
		"empty broker":         func(c *franzinbox.Config) { c.Brokers = []string{""} },
		"no topics":            func(c *franzinbox.Config) { c.Topics = nil },
		"empty topic":          func(c *franzinbox.Config) { c.Topics = []string{"orders", ""} },
		"no group":             func(c *franzinbox.Config) { c.GroupID = "" },
		"no ledger":            func(c *franzinbox.Config) { c.Processor.Ledger = nil },
		"negative workers":     func(c *franzinbox.Config) { c.Concurrency = -1 },
		"bad ordering":         func(c *franzinbox.Config) { c.Ordering = 9 },
		"negative batch":       func(c *franzinbox.Config) { c.BatchSize = -1 },
		"negative buffer":      func(c *franzinbox.Config) { c.MaxBuffered = -1 },
		"negative interval":    func(c *franzinbox.Config) { c.CommitInterval = -1 },
		"dlq is a topic":       func(c *franzinbox.Config) { c.DeadLetterTopic = "orders" },
		"a topic's dlq is one": func(c *franzinbox.Config) { c.Topics = []string{"orders", "orders.dlq"} },
	} {
		cfg := valid
		mutate(&cfg)
		err := cfg.Validate()
		require.ErrorIs(t, err, inbox.ErrConfig, name)
		_, err = franzinbox.New(cfg, nop)
		require.ErrorIs(t, err, inbox.ErrConfig, name)
	}

	c, err := franzinbox.New(valid, nop)
	require.NoError(t, err)
	got := c.Config()
	require.Equal(t, "billing", got.Processor.Scope, "scope defaults to the group")
	require.Equal(t, franzinbox.Source, got.Processor.Source)
	require.NotNil(t, got.Processor.DeadLetter)
	require.Equal(t, consumer.DefaultConcurrency, got.Concurrency)
	require.Equal(t, franzinbox.DefaultCommitInterval, got.CommitInterval)
	require.Equal(t, consumer.DefaultShutdownTimeout, got.ShutdownTimeout)
	require.Equal(t, consumer.DefaultMaxBuffered, got.MaxBuffered)
	id, err := got.Processor.ID(&consumer.Message{Headers: []consumer.Header{{Key: "ce_id", Value: []byte("x")}}})
	require.NoError(t, err)
	require.Equal(t, "x", id, "CloudEvents ce_id by default")

	// Run once.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.NoError(t, c.Run(ctx))
	require.ErrorIs(t, c.Run(ctx), consumer.ErrRunOnce)

	// A dead letter goes to "<its topic>.dlq"; Run's client publishes it,
	// so none can be published before Run.
	c2, err := franzinbox.New(valid, nop)
	require.NoError(t, err)
	require.Error(t, c2.Config().Processor.DeadLetter(context.Background(), &consumer.Message{Topic: "orders"}, nil))
}
