// Package kafkaadmin holds the Kafka administration the tools and tests
// need: creating a topic through the cluster's controller.
package kafkaadmin

import (
	"net"
	"strconv"

	"github.com/segmentio/kafka-go"
)

// CreateTopic creates topic with the given partitions (replication factor
// 1) through the controller that broker names.
func CreateTopic(broker, topic string, partitions int) error {
	conn, err := kafka.Dial("tcp", broker)
	if err != nil {
		return err
	}
	defer conn.Close()
	ctrl, err := conn.Controller()
	if err != nil {
		return err
	}
	cc, err := kafka.Dial("tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	if err != nil {
		return err
	}
	defer cc.Close()
	return cc.CreateTopics(kafka.TopicConfig{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1})
}
