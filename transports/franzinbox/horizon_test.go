package franzinbox_test

import (
	"context"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/horizontest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/transports/franzinbox"
)

// TestHorizon runs the redelivery horizon check's cases
// (harness/horizontest) over franzinbox, against the test Kafka broker.
func TestHorizon(t *testing.T) {
	horizontest.Kafka(t, horizontest.KafkaTarget{
		Source:           franzinbox.Source,
		DeadLetterSuffix: franzinbox.DeadLetterSuffix,
		CreateTopic: func(t testing.TB, brokers []string, name string, configs map[string]string) string {
			if name == "" {
				name = testsvc.Unique("jf-horizon")
			}
			cfg := map[string]*string{}
			for k, v := range configs {
				cfg[k] = &v
			}
			adm := admin(t, brokers)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			res, err := adm.CreateTopic(ctx, 2, 1, cfg, name)
			require.NoError(t, err)
			require.NoError(t, res.Err)
			testsvc.Eventually(t, 30*time.Second, func() bool {
				td, err := adm.ListTopics(ctx, name)
				return err == nil && td.Error() == nil && len(td[name].Partitions) == 2 &&
					!slices.ContainsFunc(td[name].Partitions.Numbers(), func(p int32) bool { return td[name].Partitions[p].Leader < 0 })
			}, "topic %s has leaders", name)
			return name
		},
		Produce: func(t testing.TB, brokers []string, topic string, recs []horizontest.Record) {
			rs := make([]*kgo.Record, len(recs))
			for i, r := range recs {
				rs[i] = franzinbox.NewRecord(r.ID, []byte(r.ID), []byte(r.ID))
				rs[i].Timestamp = r.Time
			}
			publish(t, brokers, topic, rs...)
		},
		Consumer: func(t testing.TB, brokers []string, topic, group string, pc consumer.Config, h consumer.Handler,
			dial func(ctx context.Context, network, addr string) (net.Conn, error)) interface {
			Run(context.Context) error
		} {
			opts := slices.Clone(fastGroup)
			if dial != nil {
				opts = append(opts, kgo.Dialer(dial))
			}
			c, err := franzinbox.New(franzinbox.Config{Brokers: brokers, Topics: []string{topic}, GroupID: group,
				Processor: pc, ClientOptions: opts}, h)
			require.NoError(t, err)
			return c
		},
	})
}
