package consumer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Header is one message header. A key may repeat (Kafka headers do);
// order is kept.
type Header struct {
	Key   string
	Value []byte
}

// Message is a delivered event, whatever the broker. Topic, Partition,
// Offset and Key say where the event sits in the broker's log, in the
// terms every log-based broker shares; a broker without one of them leaves
// it zero.
type Message struct {
	// ID is the event ID; filled by Process from the Config's IDFunc when
	// empty.
	ID string
	// Key is the key the broker orders and shards by (a Kafka message key,
	// a Kinesis partition key); nil where the broker has none (NATS).
	Key []byte
	// Topic is where the message was published: a Kafka topic, a NATS
	// subject.
	Topic string
	// Partition is the ordering shard within Topic: messages of one
	// partition are in order (a Kafka partition, a Kinesis shard); 0 where
	// the broker has a single order per topic (a JetStream stream).
	Partition int
	// Offset is the message's position within its partition (a Kafka
	// offset, a JetStream stream sequence); 0 where the broker has none
	// (core NATS).
	Offset int64
	// Headers in delivery order.
	Headers []Header
	// Value is the payload.
	Value []byte
	// Time is the broker's timestamp.
	Time time.Time
	// Attempt is the handler attempt, from 1: one more than the failures
	// of the handler counted so far. Redeliveries caused by the transport
	// (a drain, a restart, an expired AckWait) and retries caused by the
	// database being unavailable do not count. Transports keep it across
	// redeliveries of the same message.
	Attempt int
	// Uncounted is how many times this message was retried without counting
	// an attempt after its handler ran (the database went away or a race
	// was lost mid-handler). The runtime bounds it, so that no message is
	// retried forever uncounted; transports keep it with Attempt.
	Uncounted int
	// Raw is the broker client's own message (kafka.Message,
	// jetstream.Msg, *nats.Msg).
	Raw any
}

// Header returns the value of the first header named key (case-insensitive),
// and whether there was one.
func (m *Message) Header(key string) ([]byte, bool) {
	for _, h := range m.Headers {
		if strings.EqualFold(h.Key, key) {
			return h.Value, true
		}
	}
	return nil, false
}

// Errors.
var (
	// ErrNoID: no event ID could be extracted. Such a message is
	// dead-lettered (or, with Config.AllowNoID, run without dedupe); it is
	// never dropped.
	ErrNoID = errors.New("justonce/consumer: message has no event ID")
	// ErrRunOnce is what a front's Run returns when it is called again: a
	// Consumer runs once; create another to consume again.
	ErrRunOnce = errors.New("justonce/consumer: Run may be called once")
)

// IDFunc extracts the event ID from a message.
type IDFunc func(*Message) (string, error)

// HeaderID returns an IDFunc that takes the first non-empty header among
// names (case-insensitive).
func HeaderID(names ...string) IDFunc {
	return func(m *Message) (string, error) {
		for _, n := range names {
			if v, ok := m.Header(n); ok && len(v) > 0 {
				return string(v), nil
			}
		}
		return "", fmt.Errorf("%w: none of the headers %s", ErrNoID, strings.Join(names, ", "))
	}
}

// JSONField returns an IDFunc that reads a top-level string (or number)
// field of a JSON payload, for example "id" in a CloudEvents structured
// event.
func JSONField(field string) IDFunc {
	return func(m *Message) (string, error) {
		dec := json.NewDecoder(bytes.NewReader(m.Value))
		dec.UseNumber()
		var obj map[string]any
		if err := dec.Decode(&obj); err != nil {
			return "", fmt.Errorf("%w: payload is not a JSON object: %v", ErrNoID, err)
		}
		switch v := obj[field].(type) {
		case string:
			if v != "" {
				return v, nil
			}
		case json.Number:
			return v.String(), nil
		}
		return "", fmt.Errorf("%w: JSON field %q missing or empty", ErrNoID, field)
	}
}

// FirstID tries each IDFunc in turn and returns the first ID found.
func FirstID(fns ...IDFunc) IDFunc {
	return func(m *Message) (string, error) {
		var errs []error
		for _, f := range fns {
			id, err := f(m)
			if err == nil && id != "" {
				return id, nil
			}
			errs = append(errs, err)
		}
		return "", fmt.Errorf("%w: %w", ErrNoID, errors.Join(errs...))
	}
}

// DefaultID reads the CloudEvents binary-mode ce_id header (ce-id), then
// event-id, then Idempotency-Key.
var DefaultID = HeaderID("ce_id", "ce-id", "event-id", "Idempotency-Key")
