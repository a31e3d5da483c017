package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	wkafka "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// A peer is one consumer design in the comparison: how its child process
// consumes, which table it is compared in, and what it may get wrong.
type peer struct {
	name string // its row in the tables
	slug string // in flags, topics, streams and schemas
	// table: the peers of one table read the same broker and are compared
	// with its first, justonce's front for that broker.
	table string
	// broker the stream is produced to: brokerKafka, brokerNATS, or
	// brokerSQL (Watermill's Postgres table).
	broker  string
	consume func(ctx context.Context, a childArgs) error
	// mayDouble, mayLose: why the peer may double an effect after a crash,
	// or lose one whose handler failed once ("": it claims neither).
	mayDouble, mayLose string
}

// The tables and the brokers.
const (
	tableKafka = "Kafka"
	tableNATS  = "NATS JetStream"

	brokerKafka = "kafka"
	brokerNATS  = "nats"
	brokerSQL   = "sql"
)

// The peers' names, in the order of the tables.
const (
	peerJustonce      = "justonce"
	peerJustonceFranz = "justonce, franz-go"
	peerJustonceB1    = "justonce, BatchSize 1"
	peerHandwritten   = "hand-written inbox"
	peerWatermill     = "watermill kafka + dedup"
	peerWatermillSQ   = "watermill sql tx + dedup"

	peerJustonceNATS    = "justonce, JetStream"
	peerHandwrittenNATS = "hand-written inbox, JetStream"
	peerWatermillNATS   = "watermill jetstream + dedup"
)

var peers = []peer{
	{name: peerJustonce, slug: "justonce", table: tableKafka, broker: brokerKafka,
		consume: func(ctx context.Context, a childArgs) error { return consumeJustonce(ctx, a, consumer.Scheduling{}) }},
	{name: peerJustonceFranz, slug: "justonce-franz", table: tableKafka, broker: brokerKafka, consume: consumeJustonceFranz},
	{name: peerJustonceB1, slug: "justonce-b1", table: tableKafka, broker: brokerKafka,
		consume: func(ctx context.Context, a childArgs) error {
			return consumeJustonce(ctx, a, consumer.Scheduling{BatchSize: 1})
		}},
	{name: peerHandwritten, slug: "handwritten", table: tableKafka, broker: brokerKafka, consume: consumeHandwritten},
	{name: peerWatermill, slug: "watermill", table: tableKafka, broker: brokerKafka, consume: consumeWatermillKafka,
		mayDouble: "Deduplicator's memory is per process: a restart forgets it, and offsets are committed after the effect (every 1 s)",
		mayLose:   "the Deduplicator records the ID before the handler runs: the redelivery of a failed message is dropped as a duplicate"},
	{name: peerWatermillSQ, slug: "watermillsql", table: tableKafka, broker: brokerSQL, consume: consumeWatermillSQL,
		mayDouble: "offsets commit with the effect, but duplicates of events from before the restart are not in the new process's Deduplicator",
		mayLose:   "the same Deduplicator: a nacked message comes again and is dropped"},

	{name: peerJustonceNATS, slug: "justonce-nats", table: tableNATS, broker: brokerNATS, consume: consumeJustonceNATS},
	{name: peerHandwrittenNATS, slug: "handwritten-nats", table: tableNATS, broker: brokerNATS, consume: consumeHandwrittenNATS},
	{name: peerWatermillNATS, slug: "watermill-nats", table: tableNATS, broker: brokerNATS, consume: consumeWatermillNATS,
		mayDouble: "the Deduplicator's memory is per process, and a message whose ack was lost with the process comes again",
		mayLose:   "the Deduplicator records the ID before the handler runs: the redelivery of a nacked message is dropped"},
}

// peerNamed returns the peer of that name or slug.
func peerNamed(s string) (peer, bool) {
	for _, p := range peers {
		if p.name == s || p.slug == s {
			return p, true
		}
	}
	return peer{}, false
}

// effectSQL is the business effect every peer runs once per event: one row
// in effects. The table has no unique constraint, so a doubled effect shows
// as a second row.
const effectSQL = `INSERT INTO effects (event_id) VALUES ($1)`

// errInjected is the handler failure of the failure phase.
var errInjected = errors.New("injected handler failure (first attempt)")

// failOnce makes the first attempt of some event IDs fail in this process
// (when the orchestrator asks for it with PEERS_FAIL): the handler returns
// an error before its effect, as a handler that met a transient error
// does. Every peer retries a failed message; the question is whether the
// retry runs.
type failOnce struct {
	on     bool
	mu     sync.Mutex
	failed map[string]bool
}

func (f *failOnce) fail(id string) error {
	if !f.on || !failing(id) {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failed[id] {
		return nil
	}
	f.failed[id] = true
	return errInjected
}

// childArgs is what the orchestrator hands a consumer process.
type childArgs struct {
	peer    string
	topic   string // the Kafka topic, Watermill SQL topic or JetStream stream (and subject)
	group   string // the consumer group or JetStream durable
	brokers []string
	natsURL string
	pool    *pgxpool.Pool
	fail    *failOnce
}

// consume runs one peer's consumer until ctx ends.
func consume(ctx context.Context, a childArgs) error {
	p, ok := peerNamed(a.peer)
	if !ok {
		return fmt.Errorf("unknown peer %q", a.peer)
	}
	return p.consume(ctx, a)
}

// effect is the handler every justonce front runs: the failure phase's
// failure, else the business row, in the ledger's transaction.
func (a childArgs) effect(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	if err := a.fail.fail(m.ID); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, effectSQL, m.ID)
	return err
}

// consumeJustonce: kafkainbox.Consumer with its defaults, or with the
// Scheduling given. The ledger row and the effect commit in one
// transaction; offsets are committed after it.
func consumeJustonce(ctx context.Context, a childArgs, s consumer.Scheduling) error {
	ledger, err := inbox.New(a.pool, inbox.Config{})
	if err != nil {
		return err
	}
	c, err := kafkainbox.New(kafkainbox.Config{
		Brokers:    a.brokers,
		Topic:      a.topic,
		GroupID:    a.group,
		Processor:  consumer.Config{Ledger: ledger},
		Scheduling: s,
	}, a.effect)
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// consumeJustonceFranz: franzinbox.Consumer (franz-go) with its defaults.
func consumeJustonceFranz(ctx context.Context, a childArgs) error {
	ledger, err := inbox.New(a.pool, inbox.Config{})
	if err != nil {
		return err
	}
	c, err := franzinbox.New(franzinbox.Config{
		Brokers:   a.brokers,
		Topics:    []string{a.topic},
		GroupID:   a.group,
		Processor: consumer.Config{Ledger: ledger},
	}, a.effect)
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// consumeHandwritten is the inbox a user writes by hand, following the
// lifecycle of an idempotency-key table: INSERT the key as 'processing',
// run the business operation, UPDATE the key to 'done', each its own
// statement, in one transaction, then commit the Kafka offset. A key that
// already exists is a duplicate: skipped. The unique key serializes two
// transactions claiming the same ID (the second INSERT waits for the first
// to commit or roll back), so nothing doubles; a crash rolls back the
// three statements together, so nothing is lost or stuck in 'processing'.
//
// It is a plain kafka-go group reader, one message at a time, with its
// offsets committed every second (kafka-go's asynchronous commits), and the
// same group timings as justonce's consumer (10 s session timeout).
func consumeHandwritten(ctx context.Context, a childArgs) error {
	r := kafka.NewReader(kafka.ReaderConfig{
		Brokers:           a.brokers,
		Topic:             a.topic,
		GroupID:           a.group,
		CommitInterval:    time.Second,
		MaxWait:           time.Second,
		SessionTimeout:    10 * time.Second,
		RebalanceTimeout:  10 * time.Second,
		HeartbeatInterval: time.Second,
		JoinGroupBackoff:  time.Second,
	})
	defer r.Close()
	for {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("fetch: %w", err)
		}
		var id string
		for _, h := range m.Headers {
			if h.Key == idHeader {
				id = string(h.Value)
			}
		}
		for {
			err = handwrittenOnce(ctx, a.pool, id, a.fail)
			if err == nil || ctx.Err() != nil {
				break
			}
			time.Sleep(100 * time.Millisecond) // retry the message in place
		}
		if ctx.Err() != nil {
			return nil
		}
		if err := r.CommitMessages(ctx, m); err != nil && ctx.Err() == nil {
			return fmt.Errorf("commit offset: %w", err)
		}
	}
}

func handwrittenOnce(ctx context.Context, pool *pgxpool.Pool, id string, f *failOnce) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	tag, err := tx.Exec(ctx, `INSERT INTO idempotency_keys (key, status) VALUES ($1, 'processing') ON CONFLICT (key) DO NOTHING`, id)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		return nil // seen before: the row is 'done' (a 'processing' row never commits)
	}
	if err := f.fail(id); err != nil {
		return err // rolled back with the 'processing' row
	}
	if _, err := tx.Exec(ctx, effectSQL, id); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `UPDATE idempotency_keys SET status = 'done', completed_at = now() WHERE key = $1`, id); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// dedup is Watermill's Deduplicator keyed on the event ID (the event-id
// header, which Watermill's Kafka unmarshaler puts into the metadata, as
// the SQL publisher stores it), with its default repository: an in-memory
// map with a one-minute window.
func dedup() message.HandlerMiddleware {
	repo, err := middleware.NewMapExpiringKeyRepository(time.Minute)
	if err != nil {
		panic(err)
	}
	d := &middleware.Deduplicator{KeyFactory: middleware.NewMessageHasherFromMetadataField(idHeader), Repository: repo}
	return d.Middleware
}

// consumeWatermillKafka: Watermill's router with the Kafka subscriber
// (Sarama consumer group, one handler goroutine per partition, offsets
// marked on ack and auto-committed every second) and the Deduplicator
// middleware. The effect is its own statement on the pool, as a Watermill
// handler has no transaction shared with the offset.
func consumeWatermillKafka(ctx context.Context, a childArgs) error {
	sc := wkafka.DefaultSaramaSubscriberConfig()
	// Watermill's default (Kafka 1.0 protocol) is refused by Kafka 4, which
	// dropped protocol versions older than 2.1.
	sc.Version = sarama.V3_6_0_0
	sc.Consumer.Offsets.Initial = sarama.OffsetOldest
	sub, err := wkafka.NewSubscriber(wkafka.SubscriberConfig{
		Brokers:               a.brokers,
		Unmarshaler:           wkafka.DefaultMarshaler{},
		OverwriteSaramaConfig: sc,
		ConsumerGroup:         a.group,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	return runRouter(ctx, sub, a.topic, func(msg *message.Message) error {
		if err := a.fail.fail(msg.Metadata.Get(idHeader)); err != nil {
			return err
		}
		_, err := a.pool.Exec(msg.Context(), effectSQL, msg.Metadata.Get(idHeader))
		return err
	})
}

// consumeWatermillSQL: Watermill's PostgreSQL subscriber (the messages live
// in a Postgres table) in its transactional form: the handler's effect goes
// through the subscriber's transaction (TxFromContext), which also advances
// the consumer group's offset, so a message's effect and its ack commit
// together. Duplicates (the same event ID published twice) are different
// messages to it: the Deduplicator middleware drops them, in memory.
func consumeWatermillSQL(ctx context.Context, a childArgs) error {
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(a.pool), wsql.SubscriberConfig{
		ConsumerGroup:    a.group,
		SchemaAdapter:    wsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	return runRouter(ctx, sub, a.topic, func(msg *message.Message) error {
		tx, ok := wsql.TxFromContext(msg.Context())
		if !ok {
			return errors.New("watermill-sql: no transaction in the message's context")
		}
		if err := a.fail.fail(msg.Metadata.Get(idHeader)); err != nil {
			return err
		}
		_, err := tx.ExecContext(msg.Context(), effectSQL, msg.Metadata.Get(idHeader))
		return err
	})
}

func runRouter(ctx context.Context, sub message.Subscriber, topic string, h func(*message.Message) error) error {
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router.AddMiddleware(dedup())
	router.AddConsumerHandler("effects", topic, sub, h)
	return router.Run(ctx)
}
