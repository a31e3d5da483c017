package kafkainbox

import (
	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
)

// HeaderEventID is the header NewMessage puts the event ID in; the default
// ID extractor (consumer.DefaultKafkaID) reads it.
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

// isControlRecord reports whether km has the shape of a transaction marker
// (the COMMIT or ABORT record a transactional producer leaves behind):
// no headers, a 4-byte key (version 0, type 0 or 1) and a 6-byte value
// (version 0, coordinator epoch). kafka-go v0.4.x hands these out as
// ordinary messages, with either isolation level
// (segmentio/kafka-go#1332, #1446); they are not events.
func isControlRecord(km kafka.Message) bool {
	k, v := km.Key, km.Value
	return len(km.Headers) == 0 &&
		len(k) == 4 && k[0] == 0 && k[1] == 0 && k[2] == 0 && k[3] <= 1 &&
		len(v) == 6 && v[0] == 0 && v[1] == 0
}
