package consumertest

import (
	"context"
	"fmt"
	"hash/fnv"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// MemoryFront is a front as MemoryPerInFlight measures it.
type MemoryFront struct {
	// Ledger is the consumer's ledger, on a pool of at least InFlight
	// connections.
	Ledger *inbox.Ledger
	// InFlight is how many messages are held in their handlers at once.
	InFlight int
	// Start runs a consumer of the front with cfg and h until stop is
	// called: one message a transaction (BatchSize 1), InFlight of them
	// running at once (Concurrency InFlight), and room for InFlight
	// fetched messages (MaxBuffered). A Kafka front orders by key
	// (consumer.ByKey): the messages' keys fall in InFlight different
	// lanes of one partition (see LaneKeys).
	Start func(cfg consumer.Config, h consumer.Handler) (stop func())
	// Publish sends msgs to what the consumer reads, with their IDs in the
	// front's default ID header, and returns once the broker has them. It
	// runs in the measured process: use one producer for every round, so
	// that what the producer keeps is in both readings.
	Publish func(msgs []Msg)
}

// MemoryPayload is the size of the payloads MemoryPerInFlight publishes.
const MemoryPayload = 1024

// LaneKeys returns n keys that a Kafka front ordering by key
// (consumer.ByKey) with Concurrency n runs in n different lanes of one
// partition, so that none waits behind another: kafkainbox and franzinbox
// pick a key's lane as the 32-bit FNV-1a hash of the key modulo
// Concurrency.
func LaneKeys(n int) []string {
	if n < 1 {
		return nil
	}
	keys := make([]string, n)
	taken := make([]bool, n)
	for i, found := 0, 0; found < n; i++ {
		k := "k-" + strconv.Itoa(i)
		h := fnv.New32a()
		_, _ = h.Write([]byte(k))
		if lane := h.Sum32() % uint32(n); !taken[lane] {
			taken[lane] = true
			keys[lane] = k
			found++
		}
	}
	return keys
}

// MemoryPerInFlight reports the Go heap a front holds per message in
// flight, as the metric heap-B/in-flight: the front's Consumer runs; each
// round publishes f.InFlight messages (MemoryPayload bytes, the ID header,
// a key each from LaneKeys), waits until every one is in its handler,
// which blocks, inside its ledger transaction, and reads the live heap
// against the one read before the round was published; then releases
// them and waits until every one has committed. What the difference holds
// is what the messages cost from the broker's socket to the handler: the
// broker client's copies and buffers, the front's and the runtime's. The
// consumer's fixed costs (connections, the broker client's own buffers
// when idle) are in both readings. A first round, unmeasured, warms up:
// each of the pool's connections runs the ledger's statements (what pgx
// keeps per connection is not per message), and the broker client
// reaches its working size. Each iteration of b is a measured round; the
// metric is their mean, so -benchtime 1x reads what 3x does.
//
// The heap is the whole process's: run the broker in another process
// (a NATS server embedded in the test binary would be counted) and
// nothing else in the test binary meanwhile.
func MemoryPerInFlight(b *testing.B, f MemoryFront) {
	b.Helper()
	n := f.InFlight
	var (
		mu       sync.Mutex
		release  = make(chan struct{})
		entered  atomic.Int64
		executed atomic.Int64
	)
	cfg := consumer.Config{Ledger: f.Ledger, Hooks: consumer.Hooks{
		OnOutcome: func(_ *consumer.Message, out inbox.Outcome, _ time.Duration) {
			if out.Disposition == inbox.Executed {
				executed.Add(1)
			}
		},
	}}
	stop := f.Start(cfg, func(ctx context.Context, _ pgx.Tx, _ *consumer.Message) error {
		mu.Lock()
		r := release
		mu.Unlock()
		entered.Add(1)
		select {
		case <-r:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	defer stop()
	payload := make([]byte, MemoryPayload)
	keys := LaneKeys(n)
	var sum float64
	wait := func(what string, cond func() bool) {
		deadline := time.Now().Add(2 * time.Minute)
		for !cond() {
			if time.Now().After(deadline) {
				b.Fatalf("consumertest: %s within 2 minutes", what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	// settle collects twice: the second empties what sync.Pools kept
	// through the first.
	settle := func() { runtime.GC(); runtime.GC() }
	for round := -1; round < max(b.N, 1); round++ {
		settle()
		var before, during runtime.MemStats
		runtime.ReadMemStats(&before)
		// Made after the first reading: gone (published) by the second.
		msgs := make([]Msg, n)
		for i := range msgs {
			msgs[i] = Msg{ID: fmt.Sprintf("mem-%d-%d", round, i), Key: keys[i], Value: append([]byte(nil), payload...)}
		}
		f.Publish(msgs)
		msgs = nil
		wait(fmt.Sprintf("%d messages in their handlers", n), func() bool { return entered.Load() == int64(n) })
		settle()
		runtime.ReadMemStats(&during)
		entered.Store(0)
		mu.Lock()
		close(release)
		release = make(chan struct{})
		mu.Unlock()
		done := int64(round+2) * int64(n)
		wait(fmt.Sprintf("%d messages committed", done), func() bool { return executed.Load() == done })
		if round >= 0 {
			sum += float64(int64(during.HeapAlloc)-int64(before.HeapAlloc)) / float64(n)
		}
	}
	b.ReportMetric(sum/float64(max(b.N, 1)), "heap-B/in-flight")
}
