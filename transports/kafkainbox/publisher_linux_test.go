package kafkainbox_test

import (
	"testing"

	"github.com/justonce/justonce/harness/outboxtest"
)

// The test binary is the relay process TestOutboxPublisherKilledRelay
// starts and kills, when that process's environment says so.
func init() { outboxtest.RelayChild(kafkaGo) }

func TestOutboxPublisherKilledRelay(t *testing.T) { outboxtest.KilledRelay(t, kafkaGo) }
