package consumer_test

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
	"github.com/justonce/justonce/inbox"
)

// BenchmarkMemoryPerInFlight: heap held per message while its handler runs
// inside the ledger's transaction (1 KiB payload, 3 headers), measured with
// inFlight messages blocked in their handlers at once, against the heap
// before they started. per_event: each message in its own transaction
// (Process); batch: runs of 10 messages (ProcessRun), each blocked in its
// last message's handler, the 9 before it done and waiting for the
// commit. Every round is measured after an unmeasured one that ran the
// ledger's statements on every connection of the pool (what pgx keeps per
// connection is not per message), so -benchtime 1x reads what 3x does.
func BenchmarkMemoryPerInFlight(b *testing.B) {
	b.Run("per_event", func(b *testing.B) { memoryPerInFlight(b, 1) })
	b.Run("batch", func(b *testing.B) { memoryPerInFlight(b, 10) })
}

func memoryPerInFlight(b *testing.B, batch int) {
	const inFlight = 40
	pg := testsvc.Postgres(b, testsvc.MaxConns(inFlight))
	l, err := inbox.New(pg.Pool, inbox.Config{})
	require.NoError(b, err)
	ctx := context.Background()
	payload := make([]byte, 1024)
	// settle collects twice: the second empties what sync.Pools kept
	// through the first (pgx's buffers, many after the warm-up), which
	// would otherwise be freed between the two readings.
	settle := func() { runtime.GC(); runtime.GC() }
	// Round -1 warms up, unmeasured: inFlight runs at once, so that each
	// of the pool's connections runs the ledger's statements, and what pgx
	// keeps per connection (its prepared statements' descriptions, encode
	// plans) is in the heap before every measured round, as in a consumer
	// that has run for a while: it is not per message.
	for round := -1; round < max(b.N, 1); round++ {
		msgs := inFlight
		if round < 0 {
			msgs = inFlight * batch
		}
		release := make(chan struct{})
		var entered sync.WaitGroup
		entered.Add(msgs / batch)
		p, err := consumer.New(consumer.Config{Ledger: l, Scope: "mem"}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			if m.Partition != 1 {
				return nil // not its run's last: done; the run goes on
			}
			entered.Done()
			<-release
			return nil
		})
		require.NoError(b, err)
		// Warm the pool so connections are not counted.
		var warm []*pgxpool.Conn
		for i := 0; i < inFlight; i++ {
			c, err := pg.Pool.Acquire(ctx)
			require.NoError(b, err)
			warm = append(warm, c)
		}
		for _, c := range warm {
			c.Release()
		}
		settle()
		var before, during runtime.MemStats
		runtime.ReadMemStats(&before)
		var done sync.WaitGroup
		for i := 0; i < msgs; i += batch {
			done.Add(1)
			var ms []*consumer.Message
			for j := i; j < i+batch; j++ {
				last := 0
				if j == i+batch-1 {
					last = 1
				}
				ms = append(ms, &consumer.Message{Topic: "t", Partition: last, Value: append([]byte(nil), payload...), Headers: []consumer.Header{
					{Key: "ce_id", Value: []byte(fmt.Sprintf("r%d-%d-%d", batch, round, j))}, {Key: "ce_type", Value: []byte("order.paid")}, {Key: "traceparent", Value: []byte("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")}}})
			}
			go func() {
				defer done.Done()
				if batch == 1 {
					p.Process(ctx, ms[0])
					return
				}
				for _, d := range p.ProcessRun(ctx, ms, consumer.RunLimits{}) {
					if d.Action != consumer.Ack {
						b.Errorf("%v: %v", d.Action, d.Err)
					}
				}
			}()
		}
		entered.Wait()
		settle()
		runtime.ReadMemStats(&during)
		close(release)
		done.Wait()
		if round >= 0 {
			b.ReportMetric(float64(int64(during.HeapAlloc)-int64(before.HeapAlloc))/inFlight, "heap-B/in-flight")
		}
	}
}
