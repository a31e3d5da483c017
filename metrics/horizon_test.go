package metrics_test

import (
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/metrics"
)

// The hooks' OnHorizon sets the headroom gauge of the topic: the TTL less
// the broker's retention, negative when the broker outlives the ledger,
// −Inf when it keeps messages forever.
func TestConsumerCollectorHeadroom(t *testing.T) {
	t.Parallel()
	cc := metrics.NewConsumerCollector(metrics.ConsumerConfig{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(cc)
	hooks := cc.Hooks("billing", inbox.Source("kafka"))
	hooks.OnHorizon(consumer.Horizon{Topic: "short", TTL: 24 * time.Hour, Retention: 6 * time.Hour})
	hooks.OnHorizon(consumer.Horizon{Topic: "long", TTL: 24 * time.Hour, Retention: 14 * 24 * time.Hour})
	hooks.OnHorizon(consumer.Horizon{Topic: "forever", TTL: 24 * time.Hour, Unbounded: true})
	got := only(samples(t, reg), "justonce_consumer_redelivery_headroom_seconds")
	series := func(topic string) string {
		return `justonce_consumer_redelivery_headroom_seconds{scope="billing",source="kafka",topic="` + topic + `"}`
	}
	require.Len(t, got, 3)
	require.Equal(t, (18 * time.Hour).Seconds(), got[series("short")])
	require.Equal(t, (-13 * 24 * time.Hour).Seconds(), got[series("long")])
	require.True(t, math.IsInf(got[series("forever")], -1))
}
