package lanes

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/justonce/justonce/consumer"
)

// ackProc acks every message at once: what is measured is the scheduler.
type ackProc struct{}

func (ackProc) ProcessWithRetry(context.Context, *consumer.Message, func(context.Context, time.Duration) error) consumer.Decision {
	return consumer.Decision{Action: consumer.Ack}
}

func (ackProc) ProcessRun(_ context.Context, msgs []*consumer.Message, _ consumer.RunLimits) []consumer.Decision {
	ds := make([]consumer.Decision, len(msgs))
	for i := range ds {
		ds[i].Action = consumer.Ack
	}
	return ds
}

func (ackProc) Retry(_ context.Context, _ *consumer.Message, d consumer.Decision, _ func(context.Context, time.Duration) error) consumer.Decision {
	return d
}

// BenchmarkScheduler is the scheduler's own cost per message (reserve,
// enqueue, drain, settle), with messages spread over 4 partitions, in
// batches of up to DefaultBatchSize and one at a time. The processor acks
// at once (its batch decisions are one allocation per batch).
func BenchmarkScheduler(b *testing.B) {
	for _, size := range []int{consumer.DefaultBatchSize, 1} {
		b.Run("BatchSize="+strconv.Itoa(size), func(b *testing.B) {
			var settled atomic.Int64
			all := make(chan struct{})
			s := New[int](context.Background(), context.Background(), Config{
				Scheduling: consumer.Scheduling{Concurrency: 4, BatchSize: size},
				Buffer:     consumer.DefaultMaxBuffered,
				Proc:       ackProc{},
				Settle: func(*consumer.Message, consumer.Decision) {
					if settled.Add(1) == int64(b.N) {
						close(all)
					}
				},
			})
			// More messages than can be queued or running at once, so
			// that none is enqueued again while still in a lane.
			msgs := make([]consumer.Message, 4096)
			for i := range msgs {
				msgs[i].Partition = i % 4
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				m := &msgs[i%len(msgs)]
				if !s.Reserve(context.Background()) {
					b.Fatal("Reserve failed")
				}
				s.Enqueue(m.Partition, m)
			}
			<-all
			b.StopTimer()
			s.Stop()
			s.Await(Wait{})
		})
	}
}
