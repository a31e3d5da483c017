package kafkapub_test

import (
	"context"
	"errors"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/internal/kafkapub"
)

// The codes are the protocol's, as both clients name them.
func TestCodes(t *testing.T) {
	for code, names := range map[int][2]int{
		kafkapub.UnknownTopicOrPartition:     {int(kafka.UnknownTopicOrPartition), int(kerr.UnknownTopicOrPartition.Code)},
		kafkapub.MessageTooLarge:             {int(kafka.MessageSizeTooLarge), int(kerr.MessageTooLarge.Code)},
		kafkapub.InvalidTopic:                {int(kafka.InvalidTopic), int(kerr.InvalidTopicException.Code)},
		kafkapub.RecordListTooLarge:          {int(kafka.RecordListTooLarge), int(kerr.RecordListTooLarge.Code)},
		kafkapub.InvalidRequiredAcks:         {int(kafka.InvalidRequiredAcks), int(kerr.InvalidRequiredAcks.Code)},
		kafkapub.TopicAuthorizationFailed:    {int(kafka.TopicAuthorizationFailed), int(kerr.TopicAuthorizationFailed.Code)},
		kafkapub.UnsupportedForMessageFormat: {int(kafka.UnsupportedForMessageFormat), int(kerr.UnsupportedForMessageFormat.Code)},
		kafkapub.PolicyViolation:             {int(kafka.PolicyViolation), int(kerr.PolicyViolation.Code)},
		kafkapub.InvalidRecord:               {int(kafka.InvalidRecord), int(kerr.InvalidRecord.Code)},
		kafkapub.UnknownTopicID:              {int(kafka.UnknownTopicID), int(kerr.UnknownTopicID.Code)},
	} {
		require.Equal(t, code, names[0], "kafka-go")
		require.Equal(t, code, names[1], "franz-go")
		require.True(t, kafkapub.Permanent(code))
	}
	for _, transient := range []*kerr.Error{kerr.NotLeaderForPartition, kerr.RequestTimedOut, kerr.NotEnoughReplicas, kerr.LeaderNotAvailable} {
		require.False(t, kafkapub.Permanent(int(transient.Code)), transient.Message)
	}
}

// Errors: nil when all published; refusals for good wrapped in
// outbox.Permanent with the broker's text.
func TestErrors(t *testing.T) {
	require.Nil(t, kafkapub.Errors(make([]kafkapub.Answer, 3)))
	errs := kafkapub.Errors([]kafkapub.Answer{{}, {Err: kerr.MessageTooLarge, Permanent: true}, {Err: kerr.NotLeaderForPartition}})
	require.Len(t, errs, 3)
	require.NoError(t, errs[0])
	require.ErrorIs(t, errs[1], outbox.ErrPermanent)
	require.ErrorIs(t, errs[1], kerr.MessageTooLarge)
	require.Equal(t, kerr.MessageTooLarge.Error(), errs[1].Error())
	require.NotErrorIs(t, errs[2], outbox.ErrPermanent)
}

// ConfirmUnknownTopics asks once about each topic answered unknown, and
// keeps the answer permanent only for the topics the cluster does not
// know; other answers are left alone.
func TestConfirmUnknownTopics(t *testing.T) {
	unknownTopic := func(err error) bool { return errors.Is(err, kerr.UnknownTopicOrPartition) }
	msgs := []outbox.Message{{Topic: "gone"}, {Topic: "new"}, {Topic: "gone"}, {Topic: "big"}, {Topic: "ok"}}
	answers := []kafkapub.Answer{
		{Err: kerr.UnknownTopicOrPartition, Permanent: true},
		{Err: kerr.UnknownTopicOrPartition, Permanent: true},
		{Err: kerr.UnknownTopicOrPartition, Permanent: true},
		{Err: kerr.MessageTooLarge, Permanent: true},
		{},
	}
	var asked [][]string
	kafkapub.ConfirmUnknownTopics(context.Background(), msgs, answers, unknownTopic, func(_ context.Context, topics []string) map[string]bool {
		asked = append(asked, topics)
		return map[string]bool{"gone": true}
	})
	require.Equal(t, [][]string{{"gone", "new"}}, asked)
	require.Equal(t, []bool{true, false, true, true, false},
		[]bool{answers[0].Permanent, answers[1].Permanent, answers[2].Permanent, answers[3].Permanent, answers[4].Permanent})

	// The cluster not answering: nothing is confirmed.
	answers = []kafkapub.Answer{{Err: kerr.UnknownTopicOrPartition, Permanent: true}}
	kafkapub.ConfirmUnknownTopics(context.Background(), msgs[:1], answers, unknownTopic,
		func(context.Context, []string) map[string]bool { return nil })
	require.False(t, answers[0].Permanent)

	// Nothing unknown: nobody is asked.
	kafkapub.ConfirmUnknownTopics(context.Background(), msgs[3:4], []kafkapub.Answer{{Err: kerr.MessageTooLarge, Permanent: true}}, unknownTopic,
		func(context.Context, []string) map[string]bool { t.Fatal("asked"); return nil })
}
