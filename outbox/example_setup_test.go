package outbox_test

import (
	"os"
	"strings"

	"github.com/justonce/justonce/harness/kafkaadmin"
	"github.com/justonce/justonce/harness/testsvc"
)

// exampleTopic creates a fresh topic for an example (a real application
// creates its topics with its own tooling; the relay never has the broker
// create one).
func exampleTopic() string {
	name := testsvc.Unique("outbox-example")
	brokers := strings.Split(os.Getenv("KAFKA_BROKERS"), ",")
	if err := kafkaadmin.CreateTopic(brokers[0], name, 1); err != nil {
		panic(err)
	}
	return name
}
