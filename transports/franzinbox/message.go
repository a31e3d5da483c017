package franzinbox

import (
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/internal/kafkarec"
)

// HeaderEventID is the header NewRecord puts the event ID in; the default
// ID extractor (DefaultID) reads it.
const HeaderEventID = "event-id"

// NewRecord returns a record for kgo.Client.Produce or ProduceSync that
// carries id in the event-id header, so that a Consumer with the default
// ID extractor dedupes it. Produce a retry or a replay of the same event
// with the same id. Its Topic is empty: set it, or give the client a
// kgo.DefaultProduceTopic.
func NewRecord(id string, key, value []byte) *kgo.Record {
	return &kgo.Record{
		Key:     key,
		Value:   value,
		Headers: []kgo.RecordHeader{{Key: HeaderEventID, Value: []byte(id)}},
	}
}

// fromRecord turns a fetched record into the runtime's Message. Raw holds
// the *kgo.Record.
func fromRecord(r *kgo.Record) *consumer.Message {
	return kafkarec.Message(kafkarec.Record[kgo.RecordHeader]{
		Key: r.Key, Value: r.Value, Headers: r.Headers,
		Topic: r.Topic, Partition: int(r.Partition), Offset: r.Offset, Time: r.Timestamp,
	}, r)
}

// Source is what the ledger records as the source of the events this
// front runs: the same as kafkainbox's, since both read Kafka.
const Source inbox.Source = "kafka"

// DefaultID is the front's event ID extractor: consumer.DefaultID, the
// CloudEvents ce_id header, then event-id (HeaderEventID), then
// Idempotency-Key. It is kafkainbox.DefaultID too, so the two fronts
// dedupe the same records alike.
var DefaultID = consumer.DefaultID
