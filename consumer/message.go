// Package consumer is the transport-neutral runtime that makes an event
// handler run once per event ID: ID extraction, the ledger transaction,
// retry with backoff, dead-lettering, batching and the decision to ack.
//
// Transports (kafkainbox, natsinbox) turn their messages into a
// *Message, call Processor.Process (or ProcessBatch), and ack, retry or stop
// as the Decision says. Any other transport (RabbitMQ, SQS) is wrapped the
// same way:
//
//	p, _ := consumer.New(consumer.Config{Ledger: ledger, Scope: "billing"},
//		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
//			_, err := tx.Exec(ctx, `INSERT INTO invoices ...`)
//			return err
//		})
//	d := p.Process(ctx, msg) // one attempt
//	switch d.Action { case consumer.Ack: ...; case consumer.Retry: ... }
//
// # Attempts
//
// Message.Attempt counts the handler's failures: an error or panic, a data
// or constraint error (SQLSTATE classes 22 and 23, also a deferred
// constraint failing at COMMIT), a transaction the handler left aborted by
// ignoring a failed statement (inbox.ErrRolledBack). Such a failure is
// retried with Config.Backoff and, after Config.MaxAttempts, dead-lettered,
// recorded failed in the ledger and acked: nothing is acked without its
// effect, and nothing is retried forever.
//
// Transient failures (inbox.IsTransient: the database unreachable, the
// connection lost mid-handler or at COMMIT, a serialization failure or
// deadlock) are retried without counting. When the handler had run in that
// attempt, Message.Uncounted goes up by one, and past
// Config.MaxUncounted each further such failure counts, so that a handler
// that always breaks its own connection is dead-lettered in the end. When
// the handler never ran (the database could not be reached at all) the
// retry never counts, however long the outage: an outage dead-letters
// nothing.
//
// # Outages
//
// While the database is unreachable, retries wait Config.StoreBackoff,
// whose delay grows with each failed attempt of the outage, across all the
// processor's messages, and starts again from its initial value once the
// database answers. The outage is logged once when it starts (a warning)
// and once when it ends (info, with its duration and number of failed
// attempts), not once per retry.
//
// # Cancellation
//
// When the context ends, the Decision is Stop with the context's error:
// the message is neither acked nor retried here and comes again after a
// restart or rebalance. Work that committed before is acked.
package consumer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Header is one message header. Kafka headers may repeat a key; order is
// kept.
type Header struct {
	Key   string
	Value []byte
}

// Message is a delivered event, whatever the transport.
type Message struct {
	// ID is the event ID; filled by Process from the Config's IDFunc when
	// empty.
	ID string
	// Key is the Kafka message key (nil elsewhere).
	Key []byte
	// Topic is the Kafka topic or the NATS subject.
	Topic string
	// Partition is the Kafka partition (0 elsewhere).
	Partition int
	// Offset is the Kafka offset or the JetStream stream sequence.
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
	// Raw is the transport's own message (kafka.Message, jetstream.Msg).
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

// ErrNoID: no event ID could be extracted. Such a message is dead-lettered
// (or, with Config.AllowNoID, run without dedupe); it is never dropped.
var ErrNoID = errors.New("justonce/consumer: message has no event ID")

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
