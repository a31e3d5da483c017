package franzinbox

import (
	"context"
	"testing"
	"time"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/transports/internal/lanes"
	"github.com/justonce/justonce/transports/internal/offsets"
)

// heldProc acks every message at once, except the one at offset held,
// whose attempt waits for release whatever its context says (a handler
// that ignores its cancellation).
type heldProc struct {
	held    int64
	started chan struct{}
	release chan struct{}
}

func (p heldProc) ProcessWithRetry(_ context.Context, m *consumer.Message, _ func(context.Context, time.Duration) error) consumer.Decision {
	if m.Offset == p.held {
		close(p.started)
		<-p.release
	}
	return consumer.Decision{Action: consumer.Ack}
}

func (p heldProc) ProcessRun(ctx context.Context, msgs []*consumer.Message, _ consumer.RunLimits) []consumer.Decision {
	return []consumer.Decision{p.ProcessWithRetry(ctx, msgs[0], nil)}
}

func (heldProc) Retry(_ context.Context, _ *consumer.Message, d consumer.Decision, _ func(context.Context, time.Duration) error) consumer.Decision {
	return d
}

// A handler left running after its partition was revoked settles after
// the partition came back to this member: its offset must not count in
// the new assignment, whose tracking restarted below it, or the commit
// would pass messages the new assignment has not run.
func TestSettleOfAnEndedAssignmentIsNotRecorded(t *testing.T) {
	tp := topicPartition{"orders", 0}
	proc := heldProc{held: 5, started: make(chan struct{}), release: make(chan struct{})}
	s := &session{tr: offsets.NewTracker[topicPartition]()}
	s.lanes = lanes.New[topicPartition](context.Background(), context.Background(), lanes.Config{
		// Two slots: the handler left behind keeps one.
		Scheduling: consumer.Scheduling{Concurrency: 2, BatchSize: 1},
		Buffer:     10,
		Proc:       proc,
		Settle:     s.settle,
	})
	msg := func(off int64) *consumer.Message {
		return &consumer.Message{Topic: tp.topic, Partition: int(tp.partition), Offset: off}
	}
	enqueue := func(off int64) {
		if !s.lanes.TryReserve() {
			t.Fatal("no room in the buffer")
		}
		s.tr.Fetched(tp, off)
		if !s.lanes.Enqueue(tp, msg(off)) {
			t.Fatalf("offset %d refused", off)
		}
	}

	// The first assignment fetched offset 5; its handler outlives the
	// revoke (lost: forgotten and ended at once, as the lost callback
	// does), which commits nothing of it.
	enqueue(5)
	<-proc.started
	rv := s.lanes.Revoke([]topicPartition{tp})
	s.forget(map[topicPartition]bool{tp: true})
	rv.End()

	// The partition comes back from the committed offset 0; 0 and 1 run,
	// and the next poll has not returned yet when the old handler does.
	enqueue(0)
	enqueue(1)
	deadline := time.Now().Add(10 * time.Second)
	for s.tr.Committable(nil)[tp] != 2 {
		if time.Now().After(deadline) {
			t.Fatal("offsets 0 and 1 of the new assignment were not settled")
		}
		time.Sleep(time.Millisecond)
	}
	close(proc.release)
	rv.Await(lanes.Wait{})
	if got := s.tr.Committable(nil)[tp]; got != 2 {
		t.Fatalf("committable offset %d, want 2: the old assignment's offset 5 counted in the new one", got)
	}
}
