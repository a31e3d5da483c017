package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/segmentio/kafka-go"
)

// ErrPermanent marks a broker's refusal that publishing again will not
// change (a message too large, an unknown topic, no stream for a
// subject): the relay marks the message failed with the error instead of
// retrying it. errors.Is(err, ErrPermanent) on a PublishError says so.
var ErrPermanent = errors.New("justonce/outbox: refused by the broker for good")

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
	seq     int64
	id      string
	broker  Broker
	topic   string
	key     []byte
	headers []header
	value   []byte
	err     error // nil: acked
}

// permanentKafka reports whether a kafka-go error is a refusal for good.
func permanentKafka(err error) bool {
	var tooLarge kafka.MessageTooLargeError
	if errors.As(err, &tooLarge) {
		return true
	}
	var ke kafka.Error
	if errors.As(err, &ke) {
		switch ke {
		case kafka.MessageSizeTooLarge, kafka.UnknownTopicOrPartition, kafka.InvalidTopic,
			kafka.RecordListTooLarge, kafka.TopicAuthorizationFailed, kafka.InvalidRecord,
			kafka.InvalidRequiredAcks, kafka.PolicyViolation, kafka.UnsupportedForMessageFormat,
			kafka.UnknownTopicID:
			return true
		}
	}
	return false
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

// publishKafka sends msgs (one lane's, in order) with w and sets each
// one's err. A refusal of the whole call that is permanent (kafka-go
// checks sizes and topics before sending anything) is narrowed down by
// sending the messages one by one.
func publishKafka(ctx context.Context, w *kafka.Writer, msgs []*pending) {
	km := make([]kafka.Message, len(msgs))
	for i, p := range msgs {
		hs := make([]kafka.Header, 0, len(p.headers)+1)
		hs = append(hs, kafka.Header{Key: "ce_id", Value: []byte(p.id)})
		for _, h := range p.headers {
			hs = append(hs, kafka.Header{Key: h.Key, Value: h.Value})
		}
		km[i] = kafka.Message{Topic: p.topic, Key: p.key, Value: p.value, Headers: hs}
	}
	err := w.WriteMessages(ctx, km...)
	if err == nil {
		for _, p := range msgs {
			p.err = nil
		}
		return
	}
	var werr kafka.WriteErrors
	if errors.As(err, &werr) && len(werr) == len(msgs) {
		var refused []int
		for i, p := range msgs {
			p.err = kafkaErr(p, werr[i])
			if werr[i] != nil && permanentKafka(werr[i]) {
				refused = append(refused, i)
			}
		}
		// The broker refuses a partition's whole request for one message
		// (too large): send the refused ones alone to find which.
		if len(msgs) > 1 {
			for _, i := range refused {
				publishKafka(ctx, w, msgs[i:i+1])
			}
		}
		return
	}
	if len(msgs) > 1 && permanentKafka(err) {
		for i := range msgs {
			publishKafka(ctx, w, msgs[i:i+1])
		}
		return
	}
	for _, p := range msgs {
		p.err = kafkaErr(p, err)
	}
}

func kafkaErr(p *pending, err error) error {
	if err == nil {
		return nil
	}
	return &PublishError{ID: p.id, Broker: Kafka, Topic: p.topic, Permanent: permanentKafka(err), Err: err}
}

// confirmUnknownTopics turns the msgs' permanent "unknown topic" errors
// into transient ones unless the cluster itself says so. kafka-go answers
// a writer's metadata from its transport's cache, refreshed every
// MetadataTTL (6 s by default): a topic created since is "unknown" to it
// for a while. The check asks the cluster through a transport of its own,
// without creating the topic.
func confirmUnknownTopics(ctx context.Context, w *kafka.Writer, msgs []*pending) {
	unknown := map[string]bool{}
	for _, p := range msgs {
		var pe *PublishError
		if errors.As(p.err, &pe) && pe.Permanent && errors.Is(pe.Err, kafka.UnknownTopicOrPartition) {
			unknown[p.topic] = false
		}
	}
	if len(unknown) == 0 {
		return
	}
	t := &kafka.Transport{}
	if wt, ok := w.Transport.(*kafka.Transport); ok {
		t = &kafka.Transport{Dial: wt.Dial, DialTimeout: wt.DialTimeout, ClientID: wt.ClientID,
			TLS: wt.TLS, SASL: wt.SASL, Context: wt.Context, Resolver: wt.Resolver}
	}
	defer t.CloseIdleConnections()
	topics := make([]string, 0, len(unknown))
	for topic := range unknown {
		topics = append(topics, topic)
	}
	c := &kafka.Client{Addr: w.Addr, Transport: t}
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err == nil {
		for _, tp := range md.Topics {
			if _, ok := unknown[tp.Name]; ok && errors.Is(tp.Error, kafka.UnknownTopicOrPartition) {
				unknown[tp.Name] = true
			}
		}
	}
	for _, p := range msgs {
		var pe *PublishError
		if errors.As(p.err, &pe) && pe.Permanent && errors.Is(pe.Err, kafka.UnknownTopicOrPartition) && !unknown[p.topic] {
			pe.Permanent = false
		}
	}
}

// publishNATS publishes msgs asynchronously, in order on one connection,
// and waits for every ack (until ctx ends).
func publishNATS(ctx context.Context, js jetstream.JetStream, msgs []*pending) {
	futs := make([]jetstream.PubAckFuture, len(msgs))
	for i, p := range msgs {
		m := nats.NewMsg(p.topic)
		m.Data = p.value
		m.Header.Set(jetstream.MsgIDHeader, p.id)
		for _, h := range p.headers {
			m.Header.Add(h.Key, string(h.Value))
		}
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			p.err = natsErr(p, err)
			continue
		}
		futs[i] = f
	}
	for i, f := range futs {
		if f == nil {
			continue
		}
		p := msgs[i]
		select {
		case <-f.Ok():
			p.err = nil
		case err := <-f.Err():
			p.err = natsErr(p, err)
		case <-ctx.Done():
			p.err = natsErr(p, fmt.Errorf("waiting for the ack: %w", ctx.Err()))
		}
	}
}

// confirmNoStream turns the msgs' "no stream" errors (no responders:
// nothing took the publish) into transient ones unless the server says no
// stream listens on the subject: no responders is also what a stream
// between leaders, or a server restarting, answers.
func confirmNoStream(ctx context.Context, js jetstream.JetStream, msgs []*pending) {
	verdict := map[string]bool{}
	for _, p := range msgs {
		var pe *PublishError
		if !errors.As(p.err, &pe) || !pe.Permanent ||
			!(errors.Is(pe.Err, jetstream.ErrNoStreamResponse) || errors.Is(pe.Err, nats.ErrNoResponders)) {
			continue
		}
		none, ok := verdict[p.topic]
		if !ok {
			_, err := js.StreamNameBySubject(ctx, p.topic)
			none = errors.Is(err, jetstream.ErrStreamNotFound)
			verdict[p.topic] = none
		}
		if !none {
			pe.Permanent = false
		}
	}
}

func natsErr(p *pending, err error) error {
	return &PublishError{ID: p.id, Broker: NATS, Topic: p.topic, Permanent: permanentNATS(err), Err: err}
}
