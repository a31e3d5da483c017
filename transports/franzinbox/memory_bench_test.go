package franzinbox_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/franzinbox"
)

// BenchmarkMemoryPerInFlight: the heap a franzinbox Consumer holds per
// message in flight, from franz-go's client to the handler blocked in its
// ledger transaction: 40 messages of 1 KiB on one partition, each of its
// own key, run at once (ByKey, Concurrency 40, one message a
// transaction). See consumertest.MemoryPerInFlight for how it is read.
func BenchmarkMemoryPerInFlight(b *testing.B) {
	const inFlight = 40
	brokers := testsvc.KafkaBrokers(b)
	pg := testsvc.Postgres(b, testsvc.MaxConns(inFlight))
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	topic := newTopic(b, brokers, 1)
	// One producer for every round: what a client keeps is not per message.
	pr := producer(b, brokers)
	consumertest.MemoryPerInFlight(b, consumertest.MemoryFront{
		Ledger: l, InFlight: inFlight,
		Start: func(cfg consumer.Config, h consumer.Handler) func() {
			return start(b, franzinbox.Config{Brokers: brokers, Topics: []string{topic}, GroupID: topic, Processor: cfg,
				Scheduling: consumer.Scheduling{Concurrency: inFlight, Ordering: consumer.ByKey, MaxBuffered: inFlight, BatchSize: 1}}, h)
		},
		Publish: func(msgs []consumertest.Msg) {
			recs := records(msgs)
			for _, r := range recs {
				r.Topic = topic
			}
			require.NoError(b, pr.ProduceSync(context.Background(), recs...).FirstErr())
		},
	})
}
