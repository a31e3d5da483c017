package kafkapub_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/internal/kafkapub"
)

// CheckPartitions refuses a named partition the topic lacks only once a
// fresh count confirms the cached one, sends the rest (a topic it cannot
// count included), and asks nothing when no message names a partition.
func TestCheckPartitions(t *testing.T) {
	msgs := []outbox.Message{
		{Topic: "a"},
		{Topic: "a", Partition: new(int32(1))},
		{Topic: "a", Partition: new(int32(5))},
		{Topic: "b", Partition: new(int32(9))},
	}
	var asked []bool
	counts := func(cached, fresh int) func(context.Context, []string, bool) map[string]int {
		asked = nil
		return func(_ context.Context, topics []string, f bool) map[string]int {
			require.ElementsMatch(t, []string{"a", "b"}, topics)
			asked = append(asked, f)
			if f {
				return map[string]int{"a": fresh}
			}
			return map[string]int{"a": cached}
		}
	}

	answers := make([]kafkapub.Answer, len(msgs))
	send := kafkapub.CheckPartitions(context.Background(), msgs, answers, counts(2, 4))
	require.Equal(t, []int{0, 1, 3}, send)
	require.Equal(t, []bool{false, true}, asked, "the cached count, then the cluster's to confirm")
	require.True(t, answers[2].Permanent)
	require.EqualError(t, answers[2].Err, "topic a has 4 partitions: no partition 5")
	require.Equal(t, outbox.Permanent(answers[2].Err), kafkapub.Errors(answers)[2])

	answers = make([]kafkapub.Answer, len(msgs))
	send = kafkapub.CheckPartitions(context.Background(), msgs, answers, counts(2, 8))
	require.Equal(t, []int{0, 1, 2, 3}, send, "partitions added since the cache was filled")
	require.Nil(t, kafkapub.Errors(answers))

	asked = nil
	send = kafkapub.CheckPartitions(context.Background(), msgs[:1], answers[:1],
		func(context.Context, []string, bool) map[string]int { t.Fatal("asked"); return nil })
	require.Nil(t, send, "no message names a partition: all are sent, nothing asked")
}
