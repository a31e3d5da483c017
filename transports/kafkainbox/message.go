package kafkainbox

import (
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/internal/kafkarec"
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
	return kafkarec.Message(kafkarec.Record[kafka.Header]{
		Key: km.Key, Value: km.Value, Headers: km.Headers,
		Topic: km.Topic, Partition: km.Partition, Offset: km.Offset, Time: km.Time,
	}, km)
}

// Source is what the ledger records as the source of the events this
// front runs.
const Source inbox.Source = "kafka"

// DefaultID is the front's event ID extractor: consumer.DefaultID, the
// CloudEvents ce_id header, then event-id (HeaderEventID), then
// Idempotency-Key.
var DefaultID = consumer.DefaultID
