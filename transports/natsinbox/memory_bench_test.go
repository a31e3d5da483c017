package natsinbox

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/consumer/consumertest"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// BenchmarkMemoryPerInFlight: the heap a JetStream Consumer holds per
// message in flight, from the NATS client to the handler blocked in its
// ledger transaction: 40 messages of 1 KiB run at once (Concurrency 40,
// one message a transaction). The NATS server runs in a process of its
// own (testsvc.StartNATSProcess), so that its heap is not counted. See
// consumertest.MemoryPerInFlight for how it is read.
func BenchmarkMemoryPerInFlight(b *testing.B) {
	const inFlight = 40
	url := testsvc.StartNATSProcess(b).URL
	nc := connect(b, url)
	e := &env{url: url, nc: nc, js: mustJS(b, nc)}
	subject := testsvc.Unique("mem")
	stream := e.stream(b, subject, 0)
	pg := testsvc.Postgres(b, testsvc.MaxConns(inFlight))
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	consumertest.MemoryPerInFlight(b, consumertest.MemoryFront{
		Ledger: l, InFlight: inFlight,
		Start: func(cfg consumer.Config, h consumer.Handler) func() {
			c, err := New(Config{Conn: connect(b, url), Stream: stream, Durable: "mem", Processor: cfg,
				Scheduling: consumer.Scheduling{Concurrency: inFlight, MaxBuffered: inFlight, BatchSize: 1}}, h)
			require.NoError(b, err)
			return run(b, c)
		},
		Publish: func(msgs []consumertest.Msg) {
			for _, m := range msgs {
				e.publish(b, subject, m.ID, m.Value)
			}
		},
	})
}
