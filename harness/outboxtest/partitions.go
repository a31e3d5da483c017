package outboxtest

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/outbox"
)

// Placed is a message a Kafka topic holds, with its partition.
type Placed struct {
	Received
	Partition int
}

// KafkaPartitions is what Partitions needs of a Kafka target beyond
// Target.
type KafkaPartitions struct {
	// Read returns every message of dest with its partition, each
	// partition in order.
	Read func(t testing.TB, addr, dest string) []Placed
	// KeyPartition is the partition among n that key hashes to (the Java
	// client's murmur2).
	KeyPartition func(key []byte, n int) int
}

// Partitions: through the relay to a topic of 4 partitions, in one lane,
// with messages added several at a time and alone:
//
//   - a message that names its partition (outbox.Message.Partition) lands
//     there, keyed or not; the messages of a key that all name one
//     partition keep their order there;
//   - a message that names none lands on the partition its key hashes to,
//     as before, the same key's messages in order;
//   - a message that names partition 4, which the topic does not have, is
//     marked failed with the topic's count (after the cluster confirms
//     it), and the lane goes on.
func Partitions(t *testing.T, tg Target, kp KafkaPartitions) {
	t.Parallel()
	fx := newFixture(t, tg, 1)
	dest := tg.Destination(t, fx.addr, 4)
	msg := func(key, value string, partition *int32) outbox.Message {
		m := outbox.Message{Broker: tg.Broker, Topic: tg.Topic(dest, key), Value: []byte(value), Partition: partition}
		if key != "" {
			m.Key = []byte(key)
		}
		return m
	}
	fx.add(t,
		msg("a", "a0", nil), msg("b", "b0", new(int32(3))), msg("a", "a1", nil),
		msg("b", "b1", new(int32(3))), msg("", "n0", new(int32(0))), msg("b", "b2", new(int32(3))),
	)
	fx.add(t, msg("c", "c0", new(int32(1)))) // "c" hashes to 2
	refused := fx.add(t, msg("z", "z0", new(int32(4))))
	fx.add(t, msg("a", "a2", nil))
	fx.relay(t, fx.publisher(t, fx.addr), outbox.RelayConfig{})
	fx.waitDrained(t, 60*time.Second)

	where := map[string]int{}
	byPart := map[int][]string{}
	for _, p := range kp.Read(t, fx.addr, dest) {
		where[string(p.Value)] = p.Partition
		byPart[p.Partition] = append(byPart[p.Partition], string(p.Value))
	}
	require.Len(t, where, 8, "every message but the refused one, once: %v", byPart)
	a := kp.KeyPartition([]byte("a"), 4)
	for v, want := range map[string]int{"a0": a, "a1": a, "a2": a, "b0": 3, "b1": 3, "b2": 3, "n0": 0, "c0": 1} {
		require.Equal(t, want, where[v], "%s: %v", v, byPart)
	}
	inOrder := func(part int, prefix string, want ...string) {
		var got []string
		for _, v := range byPart[part] {
			if strings.HasPrefix(v, prefix) {
				got = append(got, v)
			}
		}
		require.Equal(t, want, got, "partition %d", part)
	}
	inOrder(3, "b", "b0", "b1", "b2")
	inOrder(a, "a", "a0", "a1", "a2")

	failed, err := fx.ob.Failed(context.Background(), 10)
	require.NoError(t, err)
	require.Len(t, failed, 1)
	require.Equal(t, refused[0], failed[0].ID)
	require.Contains(t, failed[0].Error, "has 4 partitions: no partition 4")
}
