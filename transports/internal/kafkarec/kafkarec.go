// Package kafkarec turns a Kafka record, as either Kafka client hands it
// out (kafka-go's kafka.Message, franz-go's *kgo.Record), into the
// runtime's consumer.Message and back, so that kafkainbox and franzinbox
// give their handlers the same Message for the same record.
package kafkarec

import (
	"time"

	"github.com/justonce/justonce/consumer"
)

// Header is a client's record header type: kafka.Header and
// kgo.RecordHeader are both a key and a value, as consumer.Header is.
type Header interface {
	~struct {
		Key   string
		Value []byte
	}
}

// Record is what a consumer.Message takes from a Kafka record.
type Record[H Header] struct {
	Key, Value []byte
	Topic      string
	Partition  int
	Offset     int64
	Time       time.Time
	Headers    []H
}

// Message returns r as the runtime's Message, its first attempt, with raw
// (the client's record) as Raw. Headers are copied.
func Message[H Header](r Record[H], raw any) *consumer.Message {
	m := &consumer.Message{
		Key:       r.Key,
		Topic:     r.Topic,
		Partition: r.Partition,
		Offset:    r.Offset,
		Value:     r.Value,
		Time:      r.Time,
		Attempt:   1,
		Raw:       raw,
	}
	if len(r.Headers) > 0 {
		m.Headers = make([]consumer.Header, len(r.Headers))
		for i, h := range r.Headers {
			m.Headers[i] = consumer.Header(h)
		}
	}
	return m
}

// Headers returns hs as a client's headers.
func Headers[H Header](hs []consumer.Header) []H {
	out := make([]H, len(hs))
	for i, h := range hs {
		out[i] = H(h)
	}
	return out
}
