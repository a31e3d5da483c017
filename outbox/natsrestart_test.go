package outbox_test

import (
	"context"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/backoff"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/outbox"
)

// The NATS server goes away while the relay publishes and comes back on
// the same port and store: the relay retries the lane (no message marked
// failed), and the stream holds every message once, in order.
func TestNATSRestartKeepsOrder(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	dir := t.TempDir()
	start := func() *server.Server {
		ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
		require.NoError(t, err)
		go ns.Start()
		require.True(t, ns.ReadyForConnections(10*time.Second))
		return ns
	}
	ns := start()
	t.Cleanup(func() { ns.Shutdown(); ns.WaitForShutdown() })

	nc, err := nats.Connect(ns.ClientURL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	subject := testsvc.Unique("restart")
	stream, err := js.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: "S-" + subject, Subjects: []string{subject}, Storage: jetstream.FileStorage, Duplicates: time.Minute,
	})
	require.NoError(t, err)

	fx := newFixture(t, 1)
	var published, retries, failed atomic.Int64
	fx.relay(t, outbox.RelayConfig{Publishers: publishers(nil, natsOn(t, js)), PublishTimeout: time.Second,
		Backoff: backoff.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond},
		Hooks: outbox.RelayHooks{
			OnPublished: func(_ outbox.Broker, _, n int) { published.Add(int64(n)) },
			OnRetry:     func(*outbox.PublishError) { retries.Add(1) },
			OnFailed:    func(*outbox.PublishError) { failed.Add(1) },
		}})
	add := func(from, to int) {
		for i := from; i < to; i++ {
			fx.add(t, outbox.Message{Broker: outbox.NATS, Topic: subject, Key: []byte("k"), Value: []byte(strconv.Itoa(i))})
		}
	}
	add(0, 50)
	testsvc.Eventually(t, 30*time.Second, func() bool { return published.Load() == 50 }, "first half published")

	ns.Shutdown()
	ns.WaitForShutdown()
	add(50, 100)
	testsvc.Eventually(t, 30*time.Second, func() bool { return retries.Load() > 0 }, "the relay retries while the server is away")
	ns = start()
	fx.waitDrained(t, 60*time.Second)
	require.Zero(t, failed.Load(), "a server away is no reason to give a message up")

	var got []string
	ids := map[string]bool{}
	info, err := stream.Info(context.Background())
	require.NoError(t, err)
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := stream.GetMsg(context.Background(), seq)
		require.NoError(t, err)
		id := m.Header.Get(jetstream.MsgIDHeader)
		require.False(t, ids[id], "%s stored twice", id)
		ids[id] = true
		got = append(got, string(m.Data))
	}
	want := make([]string, 100)
	for i := range want {
		want[i] = strconv.Itoa(i)
	}
	require.Equal(t, want, got)
	t.Logf("%d retries while the server was away", retries.Load())
}
