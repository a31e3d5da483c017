package kafkainbox

import (
	"github.com/justonce/justonce/inbox"
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
)

// HeaderEventID is the header NewMessage puts the event ID in; the default
// ID extractor (DefaultID) reads it.
const HeaderEventID = "event-id"

// NewMessage returns a message for kafka.Writer.WriteMessages that carries
// id in the event-id header, so that a Consumer with the default ID
// extractor dedupes it. Produce a retry or a replay of the same event with
// the same id.
func NewMessage(id string, key, value []byte) kafka.Message {
	return kafka.Message{
		Key:     key,
		Value:   value,
		Headers: []kafka.Header{{Key: HeaderEventID, Value: []byte(id)}},
	}
}

// fromKafka turns a fetched message into the runtime's Message. Raw holds
// the kafka.Message.
func fromKafka(km kafka.Message) *consumer.Message {
	m := &consumer.Message{
		Key:       km.Key,
		Topic:     km.Topic,
		Partition: km.Partition,
		Offset:    km.Offset,
		Value:     km.Value,
		Time:      km.Time,
		Attempt:   1,
		Raw:       km,
	}
	if len(km.Headers) > 0 {
		m.Headers = make([]consumer.Header, len(km.Headers))
		for i, h := range km.Headers {
			m.Headers[i] = consumer.Header{Key: h.Key, Value: h.Value}
		}
	}
	return m
}

func toKafkaHeaders(hs []consumer.Header) []kafka.Header {
	out := make([]kafka.Header, len(hs))
	for i, h := range hs {
		out[i] = kafka.Header{Key: h.Key, Value: h.Value}
	}
	return out
}

// Source is what the ledger records as the source of the events this
// front runs.
const Source inbox.Source = "kafka"

// DefaultID is the front's event ID extractor: consumer.DefaultID, the
// CloudEvents ce_id header, then event-id (HeaderEventID), then
// Idempotency-Key.
var DefaultID = consumer.DefaultID
