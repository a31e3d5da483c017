// Package kafkapub holds what the two Kafka outbox publishers (kafka-go's
// in kafkainbox, franz-go's in franzinbox) share: which of the Kafka
// protocol's error codes refuse a record for good, the confirmation of an
// unknown topic with the cluster, and the turning of the broker's answers
// into a Publisher's.
package kafkapub

import (
	"context"

	"github.com/justonce/justonce/outbox"
)

// Kafka protocol error codes the publishers look at.
const (
	UnknownTopicOrPartition     = 3
	MessageTooLarge             = 10
	InvalidTopic                = 17
	RecordListTooLarge          = 18
	InvalidRequiredAcks         = 21
	TopicAuthorizationFailed    = 29
	UnsupportedForMessageFormat = 43
	PolicyViolation             = 44
	InvalidRecord               = 87
	UnknownTopicID              = 100
)

// Permanent reports whether a produce answered with the error code is a
// refusal that publishing again will not change: the record is too large,
// the topic does not exist (UnknownTopicOrPartition: see Confirm), is
// invalid or forbidden, the record is invalid or against a policy, the
// acks asked for are invalid.
func Permanent(code int) bool {
	switch code {
	case UnknownTopicOrPartition, MessageTooLarge, InvalidTopic, RecordListTooLarge, InvalidRequiredAcks,
		TopicAuthorizationFailed, UnsupportedForMessageFormat, PolicyViolation, InvalidRecord, UnknownTopicID:
		return true
	}
	return false
}

// Answer is the broker's answer to one message.
type Answer struct {
	Err       error
	Permanent bool
}

// Errors returns answers as Publisher.Publish's result: nil when every
// message was published, the refusals for good wrapped in
// outbox.Permanent.
func Errors(answers []Answer) []error {
	var errs []error
	for i, a := range answers {
		if a.Err == nil {
			continue
		}
		if errs == nil {
			errs = make([]error, len(answers))
		}
		errs[i] = a.Err
		if a.Permanent {
			errs[i] = outbox.Permanent(a.Err)
		}
	}
	return errs
}

// ConfirmUnknownTopics turns the permanent answers that say the topic is
// unknown (unknownTopic(err)) into transient ones, unless the cluster
// confirms it: unknown(ctx, topics) asks it (without creating a topic)
// and returns the topics it does not know. A client's "unknown topic" may
// come from stale metadata, about a topic created since.
func ConfirmUnknownTopics(ctx context.Context, msgs []outbox.Message, answers []Answer,
	unknownTopic func(error) bool, unknown func(ctx context.Context, topics []string) map[string]bool) {
	asked := map[string]bool{}
	var topics []string
	for i, a := range answers {
		if a.Permanent && unknownTopic(a.Err) && !asked[msgs[i].Topic] {
			asked[msgs[i].Topic] = true
			topics = append(topics, msgs[i].Topic)
		}
	}
	if len(topics) == 0 {
		return
	}
	confirmed := unknown(ctx, topics)
	for i, a := range answers {
		if a.Permanent && unknownTopic(a.Err) && !confirmed[msgs[i].Topic] {
			answers[i].Permanent = false
		}
	}
}
