// Package kafkapub holds what the two Kafka outbox publishers (kafka-go's
// in kafkainbox, franz-go's in franzinbox) share: the shape of a Publish
// (Publish), which of the Kafka protocol's error codes refuse a record for
// good, the refusal of a partition the topic does not have, the
// confirmation of an unknown topic with the cluster, and the turning of
// the broker's answers into a Publisher's.
package kafkapub

import (
	"context"
	"fmt"
	"slices"

	"github.com/justonce/justonce/outbox"
)

// Client is what Publish needs of a publisher's Kafka client.
type Client struct {
	// Send sends msgs (one lane's, in order) and sets each one's answer.
	Send func(ctx context.Context, msgs []outbox.Message, answers []Answer)
	// Partitions returns the partition counts of topics (a topic it
	// cannot tell is left out). With fresh it asks the cluster; without,
	// it may answer from the client's cache. It is asked only when a
	// message names a partition, fresh only to confirm a refusal.
	Partitions func(ctx context.Context, topics []string, fresh bool) map[string]int
	// UnknownTopic reports whether a send's error says the topic is
	// unknown.
	UnknownTopic func(error) bool
	// UnknownTopics returns the topics the cluster does not know (see
	// ConfirmUnknownTopics).
	UnknownTopics func(ctx context.Context, topics []string) map[string]bool
}

// Publish is a Kafka publisher's Publish: it refuses for good the
// messages that name a partition their topic does not have, sends the
// others in order with cl.Send, confirms the unknown topics, and returns
// the answers as Publisher.Publish's result.
func Publish(ctx context.Context, cl Client, msgs []outbox.Message) []error {
	answers := make([]Answer, len(msgs))
	send := CheckPartitions(ctx, msgs, answers, cl.Partitions)
	if send == nil {
		cl.Send(ctx, msgs, answers)
	} else if len(send) > 0 {
		sub := make([]outbox.Message, len(send))
		subAnswers := make([]Answer, len(send))
		for j, i := range send {
			sub[j] = msgs[i]
		}
		cl.Send(ctx, sub, subAnswers)
		for j, i := range send {
			answers[i] = subAnswers[j]
		}
	}
	ConfirmUnknownTopics(ctx, msgs, answers, cl.UnknownTopic, cl.UnknownTopics)
	return Errors(answers)
}

// CheckPartitions refuses for good (in answers) each message that names a
// partition (outbox.Message.Partition) its topic does not have, once the
// cluster confirms the topic's partition count, and returns the indexes
// of the other messages, in order; nil when no message names a partition
// (all are to be sent, and nothing was asked). A topic whose count
// partitions cannot tell is not refused: its broker answers.
func CheckPartitions(ctx context.Context, msgs []outbox.Message, answers []Answer,
	partitions func(ctx context.Context, topics []string, fresh bool) map[string]int) []int {
	var topics []string
	for i := range msgs {
		if m := &msgs[i]; m.Partition != nil && !slices.Contains(topics, m.Topic) {
			topics = append(topics, m.Topic)
		}
	}
	if len(topics) == 0 {
		return nil
	}
	send := make([]int, 0, len(msgs))
	outside := func(counts map[string]int, m outbox.Message) bool {
		n, ok := counts[m.Topic]
		return m.Partition != nil && ok && int(*m.Partition) >= n
	}
	counts := partitions(ctx, topics, false)
	var confirmed map[string]int
	for i, m := range msgs {
		if outside(counts, m) {
			if confirmed == nil {
				// Partitions are added, never removed: a cached count may
				// be short of one added since.
				confirmed = partitions(ctx, topics, true)
			}
			if outside(confirmed, m) {
				answers[i] = Answer{Permanent: true,
					Err: fmt.Errorf("topic %s has %d partitions: no partition %d", m.Topic, confirmed[m.Topic], *m.Partition)}
				continue
			}
		}
		send = append(send, i)
	}
	return send
}

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
