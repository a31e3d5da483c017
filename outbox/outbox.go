package outbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"strconv"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// Broker says where a message goes, and so which of a relay's
// Publishers sends it. It is part of the message's lane (see Lane), not
// the client that publishes it: a Kafka message is published by whichever
// Kafka publisher the relay has (kafka-go or franz-go).
type Broker string

// The brokers the relay publishes to.
const (
	Kafka Broker = "kafka" // a Kafka topic
	NATS  Broker = "nats"  // a NATS JetStream subject
)

// Message is one message to publish once its transaction commits.
type Message struct {
	// ID names the message downstream: the publishers send it as the
	// Kafka header ce_id (KafkaIDHeader) and as the NATS header
	// Nats-Msg-Id. Empty: derived.
	// Inside a justonce handler (inbox.EventKey(ctx) is set) it is a
	// UUID derived from the event's key and inbox.Sequence(ctx), the same
	// on every run of the handler; elsewhere a random UUID.
	ID string
	// Broker is where the message goes: Kafka or NATS.
	Broker Broker
	// Topic is the Kafka topic or the NATS subject.
	Topic string
	// Key is the Kafka partition key. On NATS it only chooses the
	// message's lane: messages of one (broker, topic, key) are published
	// in the order they were added.
	Key []byte
	// Partition, when set, is the Kafka partition the message goes to
	// instead of the one its Key hashes to: Partition: new(int32(3)). Nil
	// (the zero value) hashes the Key, as the publishers always do. It
	// does not change the message's lane (hash(broker, topic, key)): the
	// messages of one key are published in the order they were added
	// whatever partitions they name, but a consumer reads partitions side
	// by side, so give every message of a key the same partition (or none)
	// to keep them in order downstream. Add refuses a negative partition
	// and a partition on NATS, which has none; a partition the topic does
	// not have is refused by the publisher for good (ErrPermanent). The
	// outbox table keeps it from migration version 5 on.
	Partition *int32
	// Headers are sent with the message, after the ID header.
	Headers []consumer.Header
	// Value is the payload.
	Value []byte
}

// DefaultLanes is the number of lanes messages are spread over
// (Config.Lanes).
const DefaultLanes = 16

// Config configures an Outbox.
type Config struct {
	// Schema holds the outbox table: the ledger's schema
	// (migrations.Config.Schema). Empty means the pool's current schema
	// (the first entry of its search_path), read once by New.
	Schema string
	// Lanes is the number of lanes messages are spread over by
	// hash(broker, topic, key). One relay at a time publishes a lane, so
	// the lane count bounds how many relays publish in parallel. Every
	// writer of a schema should use the same count: messages of one key
	// keep their order within a lane, and a changed count sends new
	// messages of a key to another lane than its pending ones. Default
	// DefaultLanes.
	Lanes int
	// Logger receives the relay's logs. Default slog.Default().
	Logger *slog.Logger
}

// Errors returned by Add.
var (
	// ErrInvalidMessage is returned (wrapped, with the reason) for a
	// message Add refuses: no topic, an unknown broker, a negative
	// partition, a partition on NATS.
	ErrInvalidMessage = errors.New("justonce/outbox: invalid message")
)

// Outbox writes messages into the outbox table in the caller's
// transaction; its Relay publishes them. It is safe for concurrent use.
type Outbox struct {
	pool   *pgxpool.Pool
	schema string
	lanes  int
	log    *slog.Logger

	table   string // quoted schema.outbox
	channel string // NOTIFY channel
}

// New returns an Outbox for the table in cfg.Schema. It queries the
// pool's current schema when cfg.Schema is empty.
func New(pool *pgxpool.Pool, cfg Config) (*Outbox, error) {
	if pool == nil {
		return nil, errors.New("justonce/outbox: nil pool")
	}
	if cfg.Lanes < 0 {
		return nil, errors.New("justonce/outbox: negative Lanes")
	}
	if cfg.Lanes == 0 {
		cfg.Lanes = DefaultLanes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	schema := cfg.Schema
	if schema == "" {
		if err := pool.QueryRow(context.Background(), `SELECT current_schema()`).Scan(&schema); err != nil {
			return nil, fmt.Errorf("justonce/outbox: current schema: %w", err)
		}
	}
	return &Outbox{
		pool:    pool,
		schema:  schema,
		lanes:   cfg.Lanes,
		log:     cfg.Logger,
		table:   pgx.Identifier{schema, "outbox"}.Sanitize(),
		channel: Channel(schema),
	}, nil
}

// Channel returns the LISTEN/NOTIFY channel on which the outbox of schema
// announces commits: "justonce_outbox." + schema, cut to Postgres' 63
// bytes.
func Channel(schema string) string {
	c := "justonce_outbox." + schema
	if len(c) > 63 {
		c = c[:63]
	}
	return c
}

// Schema returns the schema holding the outbox table.
func (o *Outbox) Schema() string { return o.schema }

type header struct {
	Key   string `json:"k"`
	Value []byte `json:"v"`
}

// Add inserts msgs in tx (the caller's transaction: a consumer handler's
// tx, httpbridge.Tx(ctx), a grpcbridge transaction, or any pgx.Tx) and
// returns their IDs in order. They are published after tx commits, never
// if it rolls back. Add injects ctx's trace context into each message's
// headers with otel.GetTextMapPropagator() (a no-op unless one is set).
//
// In a handler that Ledger.Do runs (the consumer's per-event path, the
// HTTP bridge), with the transaction it was given, the INSERT is sent with
// the ledger's commit instead of on its own (inbox.AtCommit): the message
// costs no round trip, and an INSERT that fails fails the commit.
// Elsewhere (batches, savepoints, DoTx, plain pgx) Add runs it at once.
func (o *Outbox) Add(ctx context.Context, tx pgx.Tx, msgs ...Message) ([]string, error) {
	if tx == nil {
		return nil, errors.New("justonce/outbox: nil tx")
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	n := len(msgs)
	ids := make([]string, n)
	lanes := make([]int32, n)
	brokers := make([]string, n)
	topics := make([]string, n)
	keys := make([][]byte, n)
	hdrs := make([][]byte, n)
	values := make([][]byte, n)
	var parts []*int32 // nil unless a message names a partition
	prop := otel.GetTextMapPropagator()
	var trace headerCarrier
	prop.Inject(ctx, &trace)
	for i, m := range msgs {
		if m.Broker != Kafka && m.Broker != NATS {
			return nil, fmt.Errorf("%w: unknown broker %q", ErrInvalidMessage, m.Broker)
		}
		if m.Topic == "" {
			return nil, fmt.Errorf("%w: no topic", ErrInvalidMessage)
		}
		if m.Partition != nil {
			switch {
			case m.Broker != Kafka:
				return nil, fmt.Errorf("%w: partition %d for %s %q: only Kafka topics have partitions", ErrInvalidMessage, *m.Partition, m.Broker, m.Topic)
			case *m.Partition < 0:
				return nil, fmt.Errorf("%w: negative partition %d", ErrInvalidMessage, *m.Partition)
			}
			if parts == nil {
				parts = make([]*int32, n)
			}
			p := *m.Partition
			parts[i] = &p
		}
		id := m.ID
		if id == "" {
			id = DeriveID(ctx)
		}
		ids[i] = id
		lanes[i] = int32(Lane(m.Broker, m.Topic, m.Key, o.lanes))
		brokers[i] = string(m.Broker)
		topics[i] = m.Topic
		// Copies: inside Ledger.Do the INSERT is sent with the commit,
		// after the caller may have reused its buffers.
		keys[i] = bytes.Clone(m.Key)
		values[i] = bytes.Clone(m.Value)
		if len(m.Headers) > 0 || len(trace) > 0 {
			hs := make([]header, 0, len(m.Headers)+len(trace))
			for _, h := range m.Headers {
				hs = append(hs, header{h.Key, h.Value})
			}
			for _, h := range trace {
				if !hasHeader(m.Headers, h.Key) {
					hs = append(hs, header{h.Key, h.Value})
				}
			}
			b, err := json.Marshal(hs)
			if err != nil {
				return nil, fmt.Errorf("justonce/outbox: headers: %w", err)
			}
			hdrs[i] = b
		}
	}
	// The partition column is named only when a message names a
	// partition: a writer that names none needs no migration beyond
	// version 2.
	cols := `id, lane, broker, topic, key, headers, value`
	if parts != nil {
		cols += `, partition`
	}
	var sql string
	var args []any
	if n == 1 {
		vals := `$1, $2, $3, $4, $5, $6, $7`
		args = []any{ids[0], lanes[0], brokers[0], topics[0], keys[0], jsonOrNil(hdrs[0]), values[0]}
		if parts != nil {
			vals += `, $8`
			args = append(args, parts[0])
		}
		sql = `INSERT INTO ` + o.table + ` (` + cols + `) VALUES (` + vals + `)`
	} else {
		hv := make([]*string, n)
		for i, h := range hdrs {
			if h != nil {
				s := string(h)
				hv[i] = &s
			}
		}
		arrays := `$1::text[], $2::int[], $3::text[], $4::text[], $5::bytea[], $6::jsonb[], $7::bytea[]`
		args = []any{ids, lanes, brokers, topics, keys, hv, values}
		if parts != nil {
			arrays += `, $8::int[]`
			args = append(args, parts)
		}
		sql = `INSERT INTO ` + o.table + ` (` + cols + `)
SELECT ` + cols + ` FROM unnest(` + arrays + `) WITH ORDINALITY AS m(` + cols + `, ord) ORDER BY ord`
	}
	// Inside a handler of Ledger.Do the INSERT travels with the ledger's
	// commit: no round trip of its own.
	if inbox.AtCommit(ctx, tx, sql, args...) {
		return ids, nil
	}
	if _, err := tx.Exec(ctx, sql, args...); err != nil {
		return nil, fmt.Errorf("justonce/outbox: add: %w", migrationHint(err))
	}
	return ids, nil
}

func jsonOrNil(b []byte) any {
	if b == nil {
		return nil
	}
	return string(b)
}

func hasHeader(hs []consumer.Header, k string) bool {
	for _, h := range hs {
		if h.Key == k {
			return true
		}
	}
	return false
}

// headerCarrier is a propagation.TextMapCarrier over a header list.
type headerCarrier []consumer.Header

func (c *headerCarrier) Get(key string) string {
	for _, h := range *c {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func (c *headerCarrier) Set(key, value string) {
	*c = append(*c, consumer.Header{Key: key, Value: []byte(value)})
}

func (c *headerCarrier) Keys() []string {
	out := make([]string, len(*c))
	for i, h := range *c {
		out[i] = h.Key
	}
	return out
}

// DeriveID returns the ID Add gives a message without one: inside a
// justonce handler, the UUID (RFC 9562 version 8) of the SHA-256 of the
// event's key and the next inbox.Sequence(ctx), so the n-th derived ID of
// every run of the handler is the same; elsewhere a random UUID (version 4).
func DeriveID(ctx context.Context) string {
	k, ok := inbox.EventKey(ctx)
	if !ok {
		return uuid.NewString()
	}
	return EventID(k, inbox.Sequence(ctx))
}

// EventID returns the version 8 UUID of the seq-th message of the event k:
// the first 16 bytes of SHA-256 over the length-prefixed parts
// ("justonce.outbox", scope, tenant, id, seq), with the version and
// variant bits set.
func EventID(k inbox.Key, seq int64) string {
	h := sha256.New()
	var lb [8]byte
	for _, p := range []string{"justonce.outbox", k.Scope, k.Tenant, k.ID, strconv.FormatInt(seq, 10)} {
		binary.BigEndian.PutUint64(lb[:], uint64(len(p)))
		h.Write(lb[:])
		h.Write([]byte(p))
	}
	var u uuid.UUID
	copy(u[:], h.Sum(nil))
	u[6] = u[6]&0x0f | 0x80 // version 8
	u[8] = u[8]&0x3f | 0x80 // RFC 9562 variant
	return u.String()
}

// Lane returns the lane of a message of (broker, topic, key) among lanes:
// FNV-1a of the length-prefixed parts, mod lanes.
func Lane(b Broker, topic string, key []byte, lanes int) int {
	if lanes <= 1 {
		return 0
	}
	h := fnv.New64a()
	var lb [8]byte
	for _, p := range [][]byte{[]byte(b), []byte(topic), key} {
		binary.BigEndian.PutUint64(lb[:], uint64(len(p)))
		h.Write(lb[:])
		h.Write(p)
	}
	return int(h.Sum64() % uint64(lanes))
}
