package kafkainbox_test

import (
	"strings"
	"testing"

	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/harness/outboxtest"
)

// The relay's messages that name their partition land there through
// kafka-go's publisher; the others still hash by key (murmur2).
func TestOutboxPublisherPartitions(t *testing.T) {
	outboxtest.Partitions(t, kafkaGo, outboxtest.KafkaPartitions{
		Read: func(t testing.TB, addr, dest string) []outboxtest.Placed {
			var out []outboxtest.Placed
			for _, m := range readAll(t, strings.Split(addr, ","), dest) {
				out = append(out, outboxtest.Placed{Received: outboxtest.Received{Order: string(m.Key), Value: m.Value}, Partition: m.Partition})
			}
			return out
		},
		KeyPartition: func(key []byte, n int) int {
			parts := make([]int, n)
			for i := range parts {
				parts[i] = i
			}
			return kafka.Murmur2Balancer{}.Balance(kafka.Message{Key: key}, parts...)
		},
	})
}
