package natsinbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
)

// NewOutboxPublisher returns the outbox relay's publisher of NATS messages
// to JetStream: give it as RelayConfig.Publishers[outbox.NATS]. Each
// message goes to its Topic (the subject) with the message ID in the
// header Nats-Msg-Id (so the stream drops a repeat within its duplicate
// window, and Consumer's DefaultID dedupes on it), then its headers; its
// Key only chose its lane.
//
// A batch is published asynchronously, in order on js's connection, and
// every ack awaited. What the server refuses for good is reported
// permanent (the relay marks the message failed): a message over the
// server's maximum payload or the stream's maximum message size, a bad
// subject, and no stream for the subject, once the server confirms that no
// stream listens on it (no responders is also what a stream between
// leaders, or a server restarting, answers), and a message that names a
// partition (outbox.Message.Partition: subjects have none; outbox.Add
// refuses it already). Its other errors, and ctx ending before an ack, are
// failures for the time being.
//
// js (and its connection) stays the caller's: close it after the relays
// that use the publisher have stopped.
func NewOutboxPublisher(js jetstream.JetStream) (outbox.Publisher, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: natsinbox: NewOutboxPublisher: nil JetStream", inbox.ErrConfig)
	}
	return &outboxPublisher{js: js}, nil
}

// outboxPublisher is NewOutboxPublisher's publisher.
type outboxPublisher struct {
	js jetstream.JetStream
}

// Close does nothing: the JetStream handle and its connection stay the
// caller's.
func (p *outboxPublisher) Close() error { return nil }

// Publish publishes msgs asynchronously, in order on one connection, and
// waits for every ack (until ctx ends); see NewOutboxPublisher.
func (p *outboxPublisher) Publish(ctx context.Context, msgs []outbox.Message) []error {
	errs := make([]error, len(msgs))
	futs := make([]jetstream.PubAckFuture, len(msgs))
	failed := false
	for i, m := range msgs {
		if m.Partition != nil {
			// outbox.Add refuses these; a row written otherwise is
			// refused here.
			errs[i] = outbox.Permanent(errPartition)
			failed = true
			continue
		}
		nm := nats.NewMsg(m.Topic)
		nm.Data = m.Value
		nm.Header.Set(jetstream.MsgIDHeader, m.ID)
		for _, h := range m.Headers {
			nm.Header.Add(h.Key, string(h.Value))
		}
		f, err := p.js.PublishMsgAsync(nm)
		if err != nil {
			errs[i] = err
			continue
		}
		futs[i] = f
	}
	for i, f := range futs {
		if f == nil {
			failed = true
			continue
		}
		select {
		case <-f.Ok():
		case err := <-f.Err():
			errs[i] = err
			failed = true
		case <-ctx.Done():
			errs[i] = fmt.Errorf("waiting for the ack: %w", ctx.Err())
			failed = true
		}
	}
	if !failed {
		return nil
	}
	p.classify(ctx, msgs, errs)
	return errs
}

// errPartition refuses a message that names a partition: NATS subjects
// have none.
var errPartition = errors.New("the message names a partition: NATS subjects have none")

// classify wraps the refusals for good in outbox.Permanent. A "no stream"
// answer (no responders: nothing took the publish) counts only when the
// server says no stream listens on the subject.
func (p *outboxPublisher) classify(ctx context.Context, msgs []outbox.Message, errs []error) {
	noStream := map[string]bool{}
	for i, err := range errs {
		if err == nil || !permanentNATS(err) {
			continue
		}
		if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) {
			topic := msgs[i].Topic
			none, ok := noStream[topic]
			if !ok {
				_, serr := p.js.StreamNameBySubject(ctx, topic)
				none = errors.Is(serr, jetstream.ErrStreamNotFound)
				noStream[topic] = none
			}
			if !none {
				continue
			}
		}
		errs[i] = outbox.Permanent(err)
	}
}

// permanentNATS reports whether a publish error is a refusal for good.
func permanentNATS(err error) bool {
	if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) ||
		errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, nats.ErrBadSubject) {
		return true
	}
	var api *jetstream.APIError
	if errors.As(err, &api) {
		switch api.ErrorCode {
		case jetstream.JSErrCodeStreamMessageExceedsMaximum, jetstream.JSErrCodeStreamNotFound,
			jetstream.JSErrCodeBadRequest, jetstream.JSErrCodeStreamWrongLastSequence:
			return true
		}
	}
	return false
}
