package outbox

import (
	"context"
	"errors"
	"fmt"
)

// Publisher publishes a relay's messages to one broker. The outbox
// package links no broker client: each client's publisher lives beside its
// consumer front, so a program links only the client it uses:
//
//   - kafkainbox.NewOutboxPublisher: Kafka with segmentio/kafka-go;
//   - franzinbox.NewOutboxPublisher: Kafka with twmb/franz-go;
//   - natsinbox.NewOutboxPublisher: NATS JetStream with nats.go.
//
// A relay hands a publisher the messages of its broker (RelayConfig.Publishers)
// one lane's batch at a time. Its methods are called from several
// goroutines at once (a relay publishes Concurrency lanes side by side,
// and several relays may share a publisher).
type Publisher interface {
	// Publish publishes msgs, the oldest pending messages of one lane in
	// the order they were added, and returns each message's answer:
	// errs[i] is msgs[i]'s (a nil slice: every message was published).
	//
	//   - nil: the broker has the message, durably (Kafka: acked by every
	//     in-sync replica; JetStream: the publish acked). The relay
	//     deletes it.
	//   - an error matching ErrPermanent (wrap it with Permanent): the
	//     broker refuses the message for good (too large, no such topic or
	//     stream). The relay marks it failed, with the error's text, and
	//     the lane goes on.
	//   - any other error: a failure for the time being. The message
	//     stays pending, and the relay tries its lane again after a
	//     backoff.
	//
	// Messages of one (Topic, Key) must reach the broker in the order
	// given: a later one is never acked before an earlier one is sent. A
	// Kafka publisher sends a message that names its Partition to that
	// partition (one the topic does not have: refused for good), and one
	// without to the partition its Key hashes to; a publisher whose broker
	// has no partitions refuses for good a message that names one.
	// Each message carries its ID to the broker in the header that the
	// broker's consumers dedupe on (Kafka: KafkaIDHeader; JetStream:
	// Nats-Msg-Id), then its Headers. Publish returns once every message
	// has an answer or ctx ends (bounded by RelayConfig.PublishTimeout);
	// the messages without an answer then get an error for the time being.
	Publish(ctx context.Context, msgs []Message) (errs []error)
	// Close releases what the publisher holds of its own. It leaves open
	// the client the publisher was made with, which stays its maker's to
	// close. A relay never calls it: close a publisher after the relays
	// that use it have stopped.
	Close() error
}

// KafkaIDHeader is the Kafka header in which the Kafka publishers send a
// message's ID: the CloudEvents ce_id, which kafkainbox's and
// franzinbox's DefaultID read first.
const KafkaIDHeader = "ce_id"

// ErrPermanent marks a broker's refusal that publishing again will not
// change (a message too large, an unknown topic, no stream for a
// subject): the relay marks the message failed with the error instead of
// retrying it. errors.Is(err, ErrPermanent) on a PublishError says so; a
// Publisher says so with Permanent.
var ErrPermanent = errors.New("justonce/outbox: refused by the broker for good")

// Permanent marks err, a broker's answer to one message, as a refusal for
// good (see Publisher.Publish): the result matches ErrPermanent and err
// (errors.Is, errors.As), and its text is err's. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanentError{err}
}

type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }

func (e permanentError) Unwrap() []error { return []error{e.err, ErrPermanent} }

// PublishError is a broker's answer to one message, as the relay's
// hooks see it.
type PublishError struct {
	ID     string
	Broker Broker
	Topic  string
	// Permanent says the relay marked the message failed rather than
	// retrying it.
	Permanent bool
	Err       error
}

// Error says which message the broker refused, and whether for good.
func (e *PublishError) Error() string {
	kind := "transient"
	if e.Permanent {
		kind = "permanent"
	}
	return fmt.Sprintf("justonce/outbox: publish %s to %s %q (%s): %v", e.ID, e.Broker, e.Topic, kind, e.Err)
}

// Unwrap returns the broker's error, and ErrPermanent when permanent.
func (e *PublishError) Unwrap() []error {
	if e.Permanent {
		return []error{e.Err, ErrPermanent}
	}
	return []error{e.Err}
}

// pending is one row the relay publishes.
type pending struct {
	seq    int64
	msg    Message
	broker int   // the index of msg.Broker in the relay's brokers
	err    error // nil: published
}

// publishError is the relay's PublishError for p's answer err.
func publishError(p *pending, err error) *PublishError {
	return &PublishError{ID: p.msg.ID, Broker: p.msg.Broker, Topic: p.msg.Topic, Permanent: errors.Is(err, ErrPermanent), Err: err}
}

// publish hands msgs (one broker's messages of one lane, in order) to pub
// and sets each one's err from its answer.
func publish(ctx context.Context, pub Publisher, b Broker, msgs []*pending) {
	batch := make([]Message, len(msgs))
	for i, p := range msgs {
		batch[i] = p.msg
	}
	errs := pub.Publish(ctx, batch)
	if errs != nil && len(errs) != len(msgs) {
		err := fmt.Errorf("the %s publisher answered %d messages with %d results", b, len(msgs), len(errs))
		for _, p := range msgs {
			p.err = err
		}
		return
	}
	for i, p := range msgs {
		p.err = nil
		if errs != nil {
			p.err = errs[i]
		}
	}
}
