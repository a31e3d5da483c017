package lanes

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/justonce/justonce/consumer"
)

// fakeProc is a Processor whose attempts call run (nil: ack at once); a
// Retry decision is carried on as consumer.Processor.Retry does: wait,
// then another attempt.
type fakeProc struct {
	run func(ctx context.Context, m *consumer.Message) consumer.Decision

	mu      sync.Mutex
	order   []int64 // offsets, in the order their attempts started
	batches [][]int64
}

func (p *fakeProc) attempt(ctx context.Context, m *consumer.Message) consumer.Decision {
	p.mu.Lock()
	p.order = append(p.order, m.Offset)
	p.mu.Unlock()
	if p.run == nil {
		return consumer.Decision{Action: consumer.Ack}
	}
	return p.run(ctx, m)
}

func (p *fakeProc) ProcessWithRetry(ctx context.Context, m *consumer.Message, wait func(context.Context, time.Duration) error) consumer.Decision {
	return p.Retry(ctx, m, p.attempt(ctx, m), wait)
}

func (p *fakeProc) ProcessRun(ctx context.Context, msgs []*consumer.Message, _ consumer.RunLimits) []consumer.Decision {
	var offs []int64
	for _, m := range msgs {
		offs = append(offs, m.Offset)
	}
	p.mu.Lock()
	p.batches = append(p.batches, offs)
	p.mu.Unlock()
	var ds []consumer.Decision
	for _, m := range msgs {
		d := p.attempt(ctx, m)
		ds = append(ds, d)
		if d.Action != consumer.Ack {
			break
		}
	}
	return ds
}

func (p *fakeProc) Retry(ctx context.Context, m *consumer.Message, d consumer.Decision, wait func(context.Context, time.Duration) error) consumer.Decision {
	for d.Action == consumer.Retry {
		if err := wait(ctx, d.Delay); err != nil {
			return consumer.Decision{Action: consumer.Stop, Err: err}
		}
		d = p.attempt(ctx, m)
	}
	return d
}

// holding returns a fakeProc whose attempt at offset off waits for
// release; the others ack at once.
func holding(off int64, release <-chan struct{}) *fakeProc {
	return &fakeProc{run: func(_ context.Context, m *consumer.Message) consumer.Decision {
		if m.Offset == off {
			<-release
		}
		return consumer.Decision{Action: consumer.Ack}
	}}
}

func (p *fakeProc) started() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.order)
}

// record collects settled and dropped messages.
type record struct {
	mu      sync.Mutex
	settled map[int64]consumer.Action
	dropped []int64
	changed chan struct{}
}

func newRecord() *record {
	return &record{settled: map[int64]consumer.Action{}, changed: make(chan struct{}, 1)}
}

func (r *record) settle(m *consumer.Message, d consumer.Decision) {
	r.mu.Lock()
	r.settled[m.Offset] = d.Action
	r.mu.Unlock()
	r.poke()
}

func (r *record) drop(m *consumer.Message, _ error) {
	r.mu.Lock()
	r.dropped = append(r.dropped, m.Offset)
	r.mu.Unlock()
	r.poke()
}

// allAcked fails the test unless every settled message was acked.
func (r *record) allAcked(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for off, a := range r.settled {
		if a != consumer.Ack {
			t.Fatalf("offset %d settled %v, want Ack", off, a)
		}
	}
}

func (r *record) poke() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// waitFor waits until cond holds, or fails the test after 10 s.
func (r *record) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		r.mu.Lock()
		ok := cond()
		r.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-r.changed:
		case <-time.After(10 * time.Millisecond):
		case <-deadline:
			t.Fatal("timed out waiting: " + what)
		}
	}
}

func newScheduler(t *testing.T, p Processor, rec *record, cfg Config) *Scheduler[int] {
	t.Helper()
	cfg.Proc = p
	cfg.Settle = rec.settle
	cfg.Drop = rec.drop
	if cfg.Buffer == 0 {
		cfg.Buffer = 1000
	}
	s := New[int](context.Background(), context.Background(), cfg)
	t.Cleanup(func() {
		s.Stop()
		s.Await(Wait{})
	})
	return s
}

func msg(part int, off int64, key string) *consumer.Message {
	m := &consumer.Message{Partition: part, Offset: off}
	if key != "" {
		m.Key = []byte(key)
	}
	return m
}

func enqueue(t *testing.T, s *Scheduler[int], m *consumer.Message) {
	t.Helper()
	if !s.Reserve(context.Background()) {
		t.Fatal("Reserve failed")
	}
	if !s.Enqueue(m.Partition, m) {
		t.Fatalf("Enqueue of %d refused", m.Offset)
	}
}

func TestLaneRunsItsMessagesInOrder(t *testing.T) {
	for _, size := range []int{1, 7} {
		t.Run("BatchSize "+strconv.Itoa(size), func(t *testing.T) {
			p, rec := &fakeProc{}, newRecord()
			s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 4, BatchSize: size}})
			const n = 200
			for off := range int64(n) {
				enqueue(t, s, msg(int(off%3), off, ""))
			}
			rec.waitFor(t, "every message settled", func() bool { return len(rec.settled) == n })
			perPart := map[int][]int64{}
			for _, off := range p.started() {
				perPart[int(off%3)] = append(perPart[int(off%3)], off)
			}
			for part, offs := range perPart {
				if !slices.IsSorted(offs) {
					t.Fatalf("partition %d ran out of order: %v", part, offs)
				}
			}
			rec.allAcked(t)
		})
	}
}

func TestByKeyRunsKeysOfAPartitionSideBySide(t *testing.T) {
	// Key "a"'s first message holds its lane; key "b" of the same
	// partition goes on, and "a"'s second message waits behind the first.
	release := make(chan struct{})
	p := holding(0, release)
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 4, Ordering: consumer.ByKey, BatchSize: 1}})
	a, b := "a", "b"
	if keyBucket([]byte(a), 4) == keyBucket([]byte(b), 4) {
		t.Fatal("test keys share a bucket")
	}
	enqueue(t, s, msg(0, 0, a))
	enqueue(t, s, msg(0, 1, a))
	enqueue(t, s, msg(0, 2, b))
	rec.waitFor(t, "key b settled", func() bool { _, ok := rec.settled[2]; return ok })
	rec.mu.Lock()
	_, aSecond := rec.settled[1]
	rec.mu.Unlock()
	if aSecond {
		t.Fatal("key a's second message ran before its first was done")
	}
	close(release)
	rec.waitFor(t, "key a settled", func() bool { return len(rec.settled) == 3 })
}

func TestConcurrencyBoundsTheAttemptsRunning(t *testing.T) {
	var running, most atomic.Int32
	release := make(chan struct{})
	p := &fakeProc{run: func(context.Context, *consumer.Message) consumer.Decision {
		n := running.Add(1)
		for {
			m := most.Load()
			if n <= m || most.CompareAndSwap(m, n) {
				break
			}
		}
		<-release
		running.Add(-1)
		return consumer.Decision{Action: consumer.Ack}
	}}
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 2, BatchSize: 1}})
	for part := range 6 {
		enqueue(t, s, msg(part, int64(part), ""))
	}
	rec.waitFor(t, "two attempts running", func() bool { return running.Load() == 2 })
	close(release)
	rec.waitFor(t, "every message settled", func() bool { return len(rec.settled) == 6 })
	if got := most.Load(); got != 2 {
		t.Fatalf("%d attempts ran at once, want at most 2", got)
	}
}

func TestRetryWaitGivesTheSlotBack(t *testing.T) {
	// One slot. Partition 0's message fails and waits a minute for its
	// retry; partition 1's must run meanwhile.
	p := &fakeProc{run: func(_ context.Context, m *consumer.Message) consumer.Decision {
		if m.Partition == 0 {
			return consumer.Decision{Action: consumer.Retry, Delay: time.Minute}
		}
		return consumer.Decision{Action: consumer.Ack}
	}}
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 1}})
	enqueue(t, s, msg(0, 0, ""))
	rec.waitFor(t, "partition 0 attempted", func() bool { return len(p.started()) == 1 })
	enqueue(t, s, msg(1, 1, ""))
	rec.waitFor(t, "partition 1 settled while partition 0 waits", func() bool { _, ok := rec.settled[1]; return ok })

	// Stop ends the wait: the retried message stops, and is settled so.
	s.Stop()
	s.Await(Wait{Grace: 10 * time.Second, What: "handlers", Why: "test"})
	if a, ok := rec.settled[0]; !ok || a != consumer.Stop {
		t.Fatalf("the waiting message settled %v (%v), want Stop", a, ok)
	}
}

func TestBatchLingerWaitsForMore(t *testing.T) {
	p, rec := &fakeProc{}, newRecord()
	// A buffer of one: the token of a message comes back when its lane
	// takes it, which tells when the first message is lingering.
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 3, BatchLinger: time.Minute}, Buffer: 1})
	for off := range int64(3) {
		enqueue(t, s, msg(0, off, "")) // Reserve waits until the previous one was taken
	}
	rec.waitFor(t, "the batch settled", func() bool { return len(rec.settled) == 3 })
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.batches) != 1 || len(p.batches[0]) != 3 {
		t.Fatalf("batches %v, want one of 3 (the first message lingered for the others)", p.batches)
	}
}

func TestBatchLingerEndsAtStop(t *testing.T) {
	p, rec := &fakeProc{}, newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 3, BatchLinger: time.Minute}, Buffer: 1})
	enqueue(t, s, msg(0, 0, ""))
	if !s.Reserve(context.Background()) { // the lane took it: it lingers
		t.Fatal("Reserve failed")
	}
	s.Release(1)
	done := make(chan struct{})
	go func() {
		s.Stop()
		s.Await(Wait{Grace: time.Minute})
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the stop waited for the linger")
	}
	if len(p.started()) != 0 || len(rec.dropped) != 1 {
		t.Fatalf("started %v, dropped %v: the lingering message must be dropped, not run", p.started(), rec.dropped)
	}
}

func TestStopDropsQueuedMessagesAndStartsNoAttempt(t *testing.T) {
	release := make(chan struct{})
	p := holding(0, release)
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 1}, Buffer: 10})
	for off := range int64(4) {
		enqueue(t, s, msg(0, off, ""))
	}
	rec.waitFor(t, "offset 0 running", func() bool { return len(p.started()) == 1 })
	s.Stop()
	if !slices.Equal(rec.dropped, []int64{1, 2, 3}) {
		t.Fatalf("dropped %v, want the queued 1, 2, 3", rec.dropped)
	}
	for range 10 { // the room of the dropped messages came back
		if !s.TryReserve() {
			t.Fatal("the dropped messages kept their room in the buffer")
		}
	}
	s.Release(10)
	if s.Reserve(context.Background()) {
		t.Fatal("Reserve succeeded after Stop")
	}
	close(release)
	if left := s.Await(Wait{Grace: 10 * time.Second}); left != nil {
		t.Fatal("a shutdown's wait left handlers behind")
	}
	if got := p.started(); !slices.Equal(got, []int64{0}) {
		t.Fatalf("attempts %v after the stop, want only the one in flight", got)
	}
	if rec.settled[0] != consumer.Ack {
		t.Fatal("the attempt in flight was not settled")
	}
	if !s.TryReserve() {
		t.Fatal("no room")
	}
	if s.Enqueue(0, msg(0, 9, "")) {
		t.Fatal("Enqueue accepted a message after Stop")
	}
	if !slices.Contains(rec.dropped, 9) {
		t.Fatal("a message refused after Stop was not dropped")
	}
}

func TestBatchStopsAfterAMessageThatDidNotFinish(t *testing.T) {
	// Offset 0 holds the lane while 1..4 queue behind it: they run as one
	// batch, whose second message (2) is retried; the stop ends its wait:
	// it settles Stop, and the two behind it are dropped, not run.
	release := make(chan struct{})
	p := &fakeProc{run: func(_ context.Context, m *consumer.Message) consumer.Decision {
		switch m.Offset {
		case 0:
			<-release
		case 2:
			return consumer.Decision{Action: consumer.Retry, Delay: time.Minute}
		}
		return consumer.Decision{Action: consumer.Ack}
	}}
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 4}})
	enqueue(t, s, msg(0, 0, ""))
	rec.waitFor(t, "offset 0 running", func() bool { return len(p.started()) == 1 })
	for off := range int64(4) {
		enqueue(t, s, msg(0, off+1, ""))
	}
	close(release)
	rec.waitFor(t, "offset 2 attempted", func() bool { return slices.Contains(p.started(), 2) })
	s.Stop()
	s.Await(Wait{Grace: 10 * time.Second})
	if rec.settled[1] != consumer.Ack || rec.settled[2] != consumer.Stop {
		t.Fatalf("settled %v, want 1 acked and 2 stopped", rec.settled)
	}
	if !slices.Equal(rec.dropped, []int64{3, 4}) {
		t.Fatalf("dropped %v, want 3 and 4 (behind the stopped one)", rec.dropped)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.batches) != 1 || !slices.Equal(p.batches[0], []int64{1, 2, 3, 4}) {
		t.Fatalf("batches %v, want one of 1..4 (0 ran alone)", p.batches)
	}
}

func TestFilterSkipsOrDrops(t *testing.T) {
	p, rec := &fakeProc{}, newRecord()
	s := newScheduler(t, p, rec, Config{
		Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 1},
		Filter: func(_, _ context.Context, m *consumer.Message) (skip, ok bool) {
			return m.Offset%2 == 1, true
		},
	})
	for off := range int64(4) {
		enqueue(t, s, msg(0, off, ""))
	}
	rec.waitFor(t, "every message settled", func() bool { return len(rec.settled) == 4 })
	if got := p.started(); !slices.Equal(got, []int64{0, 2}) {
		t.Fatalf("ran %v, want the unskipped 0 and 2", got)
	}
	rec.allAcked(t)
}

func TestRevokeStopsOnlyItsGroups(t *testing.T) {
	release := make(chan struct{})
	p := holding(0, release)
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 4, BatchSize: 1}})
	enqueue(t, s, msg(0, 0, "")) // held
	enqueue(t, s, msg(0, 1, "")) // queued behind it
	rec.waitFor(t, "offset 0 running", func() bool { return len(p.started()) == 1 })
	rv := s.Revoke([]int{0, 7})
	if rv.Running() != 1 || !slices.Equal(rec.dropped, []int64{1}) {
		t.Fatalf("running %d, dropped %v: want 1 lane running and offset 1 dropped", rv.Running(), rec.dropped)
	}
	enqueue(t, s, msg(1, 2, "")) // another partition goes on
	rec.waitFor(t, "partition 1 settled", func() bool { _, ok := rec.settled[2]; return ok })
	enqueue(t, s, msg(0, 3, "")) // partition 0 assigned again: a new group
	rec.waitFor(t, "partition 0's new assignment settled", func() bool { _, ok := rec.settled[3]; return ok })
	close(release)
	if left := rv.Await(Wait{Grace: 10 * time.Second, Rebalance: true}); left != nil {
		t.Fatal("left a handler behind that returned")
	}
	if rec.settled[0] != consumer.Ack {
		t.Fatal("the revoked partition's attempt in flight was not settled before End")
	}
}

func TestEndedGroupSettlesNothing(t *testing.T) {
	release := make(chan struct{})
	p := &fakeProc{run: func(context.Context, *consumer.Message) consumer.Decision {
		<-release
		return consumer.Decision{Action: consumer.Ack}
	}}
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 1}})
	enqueue(t, s, msg(0, 0, ""))
	rec.waitFor(t, "offset 0 running", func() bool { return len(p.started()) == 1 })
	rv := s.Revoke([]int{0})
	rv.End()
	close(release)
	rv.Await(Wait{})
	if len(rec.settled) != 0 {
		t.Fatalf("an ended group settled %v", rec.settled)
	}
}

func TestRebalanceLeavesBehindHandlersIgnoringCancellation(t *testing.T) {
	defer func(d time.Duration) { leaveAfter = d }(leaveAfter)
	leaveAfter = 50 * time.Millisecond
	release := make(chan struct{})
	var cancelled atomic.Bool
	p := &fakeProc{run: func(ctx context.Context, _ *consumer.Message) consumer.Decision {
		<-ctx.Done()
		cancelled.Store(true)
		<-release // ignores its cancellation
		return consumer.Decision{Action: consumer.Stop, Err: ctx.Err()}
	}}
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 1}})
	enqueue(t, s, msg(0, 0, ""))
	rec.waitFor(t, "offset 0 running", func() bool { return len(p.started()) == 1 })
	s.Stop()
	left := s.Await(Wait{Grace: 10 * time.Millisecond, What: "handlers", Why: "rebalance", Rebalance: true})
	if left == nil {
		t.Fatal("the rebalance's wait did not leave the handler behind")
	}
	if !cancelled.Load() {
		t.Fatal("the handler was not cancelled")
	}
	select {
	case <-left:
		t.Fatal("left reported the handler returned while it runs")
	default:
	}
	close(release)
	select {
	case <-left:
	case <-time.After(10 * time.Second):
		t.Fatal("left did not close once the handler returned")
	}
}

func TestShutdownWaitCutByARebalance(t *testing.T) {
	release := make(chan struct{})
	p := &fakeProc{run: func(ctx context.Context, _ *consumer.Message) consumer.Decision {
		select {
		case <-ctx.Done():
			return consumer.Decision{Action: consumer.Stop, Err: ctx.Err()}
		case <-release:
			return consumer.Decision{Action: consumer.Ack}
		}
	}}
	defer close(release)
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 1, BatchSize: 1}})
	enqueue(t, s, msg(0, 0, ""))
	rec.waitFor(t, "offset 0 running", func() bool { return len(p.started()) == 1 })
	s.Stop()
	cut := make(chan struct{})
	close(cut)
	start := time.Now()
	s.Await(Wait{Grace: time.Minute, What: "handlers", Why: "shutdown", Cut: cut, RebalanceGrace: 20 * time.Millisecond})
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("the wait took %s: the cut did not shorten it", took)
	}
	if rec.settled[0] != consumer.Stop {
		t.Fatalf("the handler settled %v, want Stop (cancelled)", rec.settled[0])
	}
}

func TestWideLaneRunsSideBySide(t *testing.T) {
	// One lane drained by three goroutines (natsinbox): three messages
	// held at once.
	var running atomic.Int32
	release := make(chan struct{})
	p := &fakeProc{run: func(context.Context, *consumer.Message) consumer.Decision {
		running.Add(1)
		<-release
		return consumer.Decision{Action: consumer.Ack}
	}}
	rec := newRecord()
	s := newScheduler(t, p, rec, Config{Scheduling: consumer.Scheduling{Concurrency: 3, BatchSize: 1}, Width: 3})
	for off := range int64(5) {
		enqueue(t, s, msg(0, off, ""))
	}
	rec.waitFor(t, "three running", func() bool { return running.Load() == 3 })
	close(release)
	rec.waitFor(t, "every message settled", func() bool { return len(rec.settled) == 5 })
	if running.Load() != 5 {
		t.Fatal("not every message ran")
	}
}

func TestStopWithTheStopContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	p, rec := &fakeProc{}, newRecord()
	s := New[int](ctx, context.Background(), Config{Scheduling: consumer.Scheduling{Concurrency: 1}, Buffer: 1, Proc: p, Settle: rec.settle, Drop: rec.drop})
	cancel()
	if s.Reserve(context.Background()) {
		t.Fatal("Reserve succeeded after the stop context ended")
	}
	if s.Stopping().Err() == nil || !errors.Is(context.Cause(s.Stopping()), context.Canceled) {
		t.Fatal("Stopping did not end with the stop context")
	}
	if s.Context().Err() != nil {
		t.Fatal("the attempts' context ended with the stop context")
	}
}
