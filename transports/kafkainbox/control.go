package kafkainbox

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
)

// looksLikeMarker reports whether km has the shape of a transaction marker
// (the COMMIT or ABORT record a transactional producer leaves behind): no
// headers and a 4-byte key holding version 0 and type 0 (abort) or 1
// (commit). kafka-go v0.4.x hands these out as ordinary messages, with
// either isolation level, and gives no way to tell them from records; a
// plain record can have the same shape. The shape only selects the records
// whose batch is then looked at (controlChecker).
func looksLikeMarker(km kafka.Message) bool {
	k := km.Key
	return len(km.Headers) == 0 &&
		len(k) == 4 && k[0] == 0 && k[1] == 0 && k[2] == 0 && k[3] <= 1
}

// controlChecker tells, by asking the partition leader for the record
// batch that holds an offset, whether that offset is a control record
// (its batch has the control attribute) or a plain record.
type controlChecker struct {
	client    *kafka.Client
	transport *kafka.Transport

	mu    sync.Mutex
	known map[topicPartition]*controlRange
}

// controlRange is what the last fetch of a partition showed: the offsets
// from..to it covered, and which of them are control records.
type controlRange struct {
	from, to int64
	control  map[int64]bool
}

func newControlChecker(brokers []string, d *kafka.Dialer) *controlChecker {
	t := &kafka.Transport{}
	if d != nil {
		t.Dial = d.DialFunc
		t.TLS = d.TLS
		t.SASL = d.SASLMechanism
		t.ClientID = d.ClientID
		if d.Timeout > 0 {
			t.DialTimeout = d.Timeout
		}
	}
	return &controlChecker{
		client:    &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second, Transport: t},
		transport: t,
		known:     map[topicPartition]*controlRange{},
	}
}

func (c *controlChecker) close() { c.transport.CloseIdleConnections() }

// isControl reports whether the record at offset of tp is a control
// record. An error means the broker could not say; the caller retries.
func (c *controlChecker) isControl(ctx context.Context, tp topicPartition, offset int64) (bool, error) {
	c.mu.Lock()
	if r := c.known[tp]; r != nil && offset >= r.from && offset <= r.to {
		ctl := r.control[offset]
		c.mu.Unlock()
		return ctl, nil
	}
	c.mu.Unlock()

	res, err := c.client.Fetch(ctx, &kafka.FetchRequest{
		Topic:          tp.topic,
		Partition:      tp.partition,
		Offset:         offset,
		MinBytes:       1,
		MaxBytes:       1 << 20,
		MaxWait:        100 * time.Millisecond,
		IsolationLevel: kafka.ReadUncommitted, // control batches are returned either way
	})
	if err != nil {
		return false, err
	}
	if errors.Is(res.Error, kafka.OffsetOutOfRange) {
		// Deleted by retention since it was read: nothing says it was a
		// control record, so it is not skipped.
		return false, nil
	}
	if res.Error != nil {
		return false, res.Error
	}
	r, err := readControlRange(res.Records)
	if err != nil {
		return false, err
	}
	if r == nil || offset < r.from || offset > r.to {
		// Not in the log any more (compacted): not known to be a control
		// record, so it is not skipped.
		return false, nil
	}
	c.mu.Lock()
	c.known[tp] = r
	c.mu.Unlock()
	return r.control[offset], nil
}

// readControlRange walks the batches of a fetch response and records which
// offsets belong to control batches.
func readControlRange(rr kafka.RecordReader) (*controlRange, error) {
	r := &controlRange{from: -1, to: -1, control: map[int64]bool{}}
	stream, ok := rr.(*protocol.RecordStream)
	if !ok {
		return nil, nil // no batches
	}
	for _, batch := range stream.Records {
		_, ctl := batch.(*protocol.ControlBatch)
		for {
			rec, err := batch.ReadRecord()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return nil, err
			}
			if r.from < 0 || rec.Offset < r.from {
				r.from = rec.Offset
			}
			if rec.Offset > r.to {
				r.to = rec.Offset
			}
			if ctl {
				r.control[rec.Offset] = true
			}
			if rec.Key != nil {
				rec.Key.Close()
			}
			if rec.Value != nil {
				rec.Value.Close()
			}
		}
	}
	if r.from < 0 {
		return nil, nil
	}
	return r, nil
}
