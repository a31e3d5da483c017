package natsinbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/outboxtest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/outbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

// jetStream is the NATS JetStream outbox publisher under the relay's
// end-to-end tests (harness/outboxtest), against a NATS server embedded
// in the test. A destination is a stream on the subjects dest.>, a key's
// messages going to dest.key.
var jetStream = outboxtest.Target{
	Name:   "jetstream",
	Broker: outbox.NATS,
	Addr:   testsvc.NATSURL,
	Publisher: func(url string) (outbox.Publisher, func(), error) {
		// Publishes while disconnected fail at once rather than wait in
		// the client's buffer (the relay retries them).
		nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond),
			nats.RetryOnFailedConnect(true), nats.ReconnectBufSize(-1))
		if err != nil {
			return nil, nil, err
		}
		js, err := jetstream.New(nc)
		if err != nil {
			nc.Close()
			return nil, nil, err
		}
		p, err := natsinbox.NewOutboxPublisher(js)
		if err != nil {
			nc.Close()
			return nil, nil, err
		}
		return p, func() { _ = p.Close(); nc.Close() }, nil
	},
	Server: func(url string) string { return strings.TrimPrefix(url, "nats://") },
	At:     func(hostPort string) string { return "nats://" + hostPort },
	Destination: func(t testing.TB, url string, _ int) string {
		dest := testsvc.Unique("ob")
		// A short duplicate window: a message the relay publishes again
		// (after a kill) is stored again, for the consumer to dedupe.
		_, err := js(t, url).CreateStream(context.Background(), jetstream.StreamConfig{
			Name: streamOf(dest), Subjects: []string{dest + ".>"}, Storage: jetstream.FileStorage, Duplicates: 100 * time.Millisecond,
		})
		require.NoError(t, err)
		return dest
	},
	Topic: func(dest, key string) string { return dest + "." + key },
	Read: func(t testing.TB, url, dest string) []outboxtest.Received {
		ctx := context.Background()
		s, err := js(t, url).Stream(ctx, streamOf(dest))
		require.NoError(t, err)
		info, err := s.Info(ctx)
		require.NoError(t, err)
		var out []outboxtest.Received
		for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
			m, err := s.GetMsg(ctx, seq)
			if errors.Is(err, jetstream.ErrMsgNotFound) {
				continue
			}
			require.NoError(t, err)
			r := outboxtest.Received{ID: m.Header.Get(jetstream.MsgIDHeader), Order: m.Subject, Value: m.Data}
			for k, vs := range m.Header {
				for _, v := range vs {
					r.Headers = append(r.Headers, consumer.Header{Key: k, Value: []byte(v)})
				}
			}
			out = append(out, r)
		}
		return out
	},
	Produce: func(t testing.TB, url, dest string, events []outboxtest.Event) {
		j := js(t, url)
		for _, e := range events {
			m := nats.NewMsg(dest + "." + e.Key)
			m.Data = e.Value
			m.Header.Set(jetstream.MsgIDHeader, e.ID)
			_, err := j.PublishMsg(context.Background(), m)
			require.NoError(t, err)
		}
	},
	Consumer: func(t testing.TB, url, dest, group string, pc consumer.Config, h consumer.Handler) interface {
		Run(context.Context) error
	} {
		c, err := natsinbox.New(natsinbox.Config{Conn: conn(t, url), Stream: streamOf(dest), Durable: group, Processor: pc,
			DeadLetterSubject: dest + "-dlq"}, h) // outside dest.>
		require.NoError(t, err)
		return c
	},
	Refused: func(t testing.TB, url, dest string) []outboxtest.Refusal {
		return []outboxtest.Refusal{
			{Message: outbox.Message{Broker: outbox.NATS, Topic: testsvc.Unique("nostream"), Key: []byte("k"), Value: []byte("no stream")},
				Want: "no response from stream"},
			// Over the server's max_payload (1 MiB).
			{Message: outbox.Message{Broker: outbox.NATS, Topic: dest + ".k", Key: []byte("k"), Value: make([]byte, 2<<20)},
				Want: "maximum payload exceeded"},
		}
	},
}

// streamOf names dest's stream.
func streamOf(dest string) string { return "S-" + dest }

// conn is a connection to url, closed when the test ends.
func conn(t testing.TB, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

// js is a JetStream handle on a connection to url of its own.
func js(t testing.TB, url string) jetstream.JetStream {
	t.Helper()
	j, err := jetstream.New(conn(t, url))
	require.NoError(t, err)
	return j
}

func TestOutboxPublisherRefusals(t *testing.T)   { outboxtest.Refusals(t, jetStream) }
func TestOutboxPublisherBrokerAway(t *testing.T) { outboxtest.BrokerAway(t, jetStream) }
func TestOutboxPublisherTwoHop(t *testing.T)     { outboxtest.TwoHop(t, jetStream) }

// natsinbox links nats.go alone of the broker clients: its outbox
// publisher brings no Kafka client.
func TestOutboxPublisherLinksOnlyNATS(t *testing.T) {
	outboxtest.LinksNone(t, "github.com/segmentio/", "github.com/twmb/franz-go")
}

// NewOutboxPublisher needs a JetStream handle.
func TestOutboxPublisherConfig(t *testing.T) {
	_, err := natsinbox.NewOutboxPublisher(nil)
	require.ErrorIs(t, err, inbox.ErrConfig)
}
