package kafkainbox_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/horizontest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/kafkainbox"
)

// TestHorizon runs the redelivery horizon check's cases
// (harness/horizontest) over kafkainbox, against the test Kafka broker.
func TestHorizon(t *testing.T) {
	horizontest.Kafka(t, horizontest.KafkaTarget{
		Source:           kafkainbox.Source,
		DeadLetterSuffix: kafkainbox.DeadLetterSuffix,
		CreateTopic: func(t testing.TB, brokers []string, name string, configs map[string]string) string {
			if name == "" {
				name = testsvc.Unique("jo-horizon")
			}
			tc := kafka.TopicConfig{Topic: name, NumPartitions: 2, ReplicationFactor: 1}
			for k, v := range configs {
				tc.ConfigEntries = append(tc.ConfigEntries, kafka.ConfigEntry{ConfigName: k, ConfigValue: v})
			}
			createTopics(t, brokers, tc)
			return name
		},
		Produce: func(t testing.TB, brokers []string, topic string, recs []horizontest.Record) {
			msgs := make([]kafka.Message, len(recs))
			for i, r := range recs {
				msgs[i] = kafkainbox.NewMessage(r.ID, []byte(r.ID), []byte(r.ID))
				msgs[i].Time = r.Time
			}
			publish(t, brokers, topic, msgs...)
		},
		Consumer: func(t testing.TB, brokers []string, topic, group string, pc consumer.Config, h consumer.Handler,
			dial func(ctx context.Context, network, addr string) (net.Conn, error)) interface {
			Run(context.Context) error
		} {
			c, err := kafkainbox.New(kafkainbox.Config{Brokers: brokers, Topic: topic, GroupID: group, Processor: pc,
				Reader: func(rc *kafka.ReaderConfig) {
					tuneReader(rc)
					if dial != nil {
						rc.Dialer = &kafka.Dialer{Timeout: 10 * time.Second, DialFunc: dial}
					}
				}}, h)
			require.NoError(t, err)
			return c
		},
	})
}
