// Package lanes is the scheduler under every consumer front: the lanes of
// messages that must run one after the other, their batches, the
// Concurrency slots, the buffer of fetched messages (MaxBuffered), and
// the stop, cancellation and shutdown wait of a whole consumer or of some
// of its partitions. kafkainbox, franzinbox and natsinbox (JetStream) feed
// it the messages they fetch and are called back with each decision.
//
// A Scheduler holds groups (a partition, stopped and cancelled together),
// each of lanes (the partition's own, or a key bucket of it with
// consumer.ByKey). A lane is a queue drained by up to Config.Width
// goroutines (1: in order), each taking the messages waiting at its head,
// up to BatchSize, and running them through the consumer.Processor: one
// alone with ProcessWithRetry, several with ProcessRun, each decision
// carried on with Retry before the messages behind it run. An attempt
// takes one of Concurrency slots while it runs and gives it back while the
// retry loop waits, so that a message waiting to be retried holds up its
// own lane only.
//
// Fronts feed it through callbacks: Filter (a message that must not run:
// kafkainbox's transaction markers), Start (messages taken to run:
// natsinbox's heartbeat), Settle (each final decision: an offset marked
// done, a message acked) and Drop (a message taken from the broker that
// will not run here: natsinbox hands it back).
package lanes

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/justonce/justonce/consumer"
)

// Config configures a Scheduler.
type Config struct {
	// Scheduling: Concurrency (the slots), Ordering (ByKey: a lane per key
	// bucket), BatchSize, BatchMaxTime, BatchLinger. Its MaxBuffered is
	// not read: Buffer is.
	consumer.Scheduling
	// Buffer is how many messages may wait in the lanes (Reserve's
	// tokens). At least 1.
	Buffer int
	// Width is how many goroutines may drain one lane at once. 0 or 1: a
	// lane runs in order. natsinbox's single lane has Concurrency.
	Width int
	// Proc runs the messages (a *consumer.Processor). Required.
	Proc Processor

	// Filter, when set, is asked about each message before it runs: skip
	// true settles it as acked without running it; ok false means the
	// lane stopped while Filter waited (the message is dropped). run is
	// the context attempts run on, stopping ends when the lane stops.
	Filter func(run, stopping context.Context, m *consumer.Message) (skip, ok bool)
	// Start, when set, is told the messages a lane took to run, before
	// Filter.
	Start func(ms []*consumer.Message)
	// Settle records a message's final decision (Ack, or Stop); never
	// after its group ended (Revoked.End). Required.
	Settle func(m *consumer.Message, d consumer.Decision)
	// Drop, when set, is told of a message taken from the broker that
	// will not run here: queued at a stop or revoke, or behind a message
	// that stopped. cause is the stop's.
	Drop func(m *consumer.Message, cause error)

	// Log and Name ("justonce kafka") for the shutdown's warnings.
	Log  *slog.Logger
	Name string
}

// Processor is what a Scheduler runs messages with: *consumer.Processor.
type Processor interface {
	ProcessWithRetry(ctx context.Context, m *consumer.Message, wait func(context.Context, time.Duration) error) consumer.Decision
	ProcessRun(ctx context.Context, msgs []*consumer.Message, lim consumer.RunLimits) []consumer.Decision
	Retry(ctx context.Context, m *consumer.Message, d consumer.Decision, wait func(context.Context, time.Duration) error) consumer.Decision
}

var _ Processor = (*consumer.Processor)(nil)

// Scheduler runs fetched messages in lanes. Create it with New; K names a
// group (a partition). It is safe for concurrent use.
type Scheduler[K comparable] struct {
	cfg      Config
	size     int                // BatchSize, at least 1
	width    int                // Width, at least 1
	stopping context.Context    // ends at Stop: no new attempts
	stop     context.CancelFunc // ends stopping
	run      context.Context    // attempts run on it
	cancel   context.CancelFunc // cancels run

	buffered chan struct{} // a token per message reserved and not yet taken from its lane
	slots    chan struct{} // a token per attempt running
	wg       sync.WaitGroup

	mu      sync.Mutex
	groups  map[K]*group
	stopped bool // Stop was called; guarded by mu
}

// group is one partition: its lanes and the contexts its attempts run
// under. lanes is guarded by Scheduler.mu.
type group struct {
	stopping context.Context
	stop     context.CancelFunc
	run      context.Context
	cancel   context.CancelFunc
	lanes    map[int]*lane // by key bucket; -1: the partition's own
	wg       sync.WaitGroup

	settleMu sync.RWMutex // settles (read) against End (write)
	ended    bool
}

// lane is a queue of messages. Fields other than more are guarded by
// Scheduler.mu.
type lane struct {
	q        []*consumer.Message
	head     int           // q[head:] is waiting
	drainers int           // goroutines draining it
	more     chan struct{} // signalled when a message is added (batch linger)
}

// New returns a Scheduler. Its lanes stop when stop ends or at Stop;
// attempts run on a context that keeps run's values but not its
// cancellation, cancelled by Cancel (or Await).
func New[K comparable](stop, run context.Context, cfg Config) *Scheduler[K] {
	s := &Scheduler[K]{
		cfg:      cfg,
		size:     max(1, cfg.BatchSize),
		width:    max(1, cfg.Width),
		buffered: make(chan struct{}, max(1, cfg.Buffer)),
		slots:    make(chan struct{}, max(1, cfg.Concurrency)),
		groups:   map[K]*group{},
	}
	if s.cfg.Log == nil {
		s.cfg.Log = slog.New(slog.DiscardHandler)
	}
	s.stopping, s.stop = context.WithCancel(stop)
	s.run, s.cancel = context.WithCancel(context.WithoutCancel(run))
	return s
}

// Context is the context attempts run on: cancelled by Cancel.
func (s *Scheduler[K]) Context() context.Context { return s.run }

// Stopping ends when the lanes stop.
func (s *Scheduler[K]) Stopping() context.Context { return s.stopping }

// Cap is the buffer's size: how many messages may be reserved at once.
func (s *Scheduler[K]) Cap() int { return cap(s.buffered) }

// Reserve takes room for one message in the buffer, waiting for it; false
// when ctx ended or the lanes stopped first.
func (s *Scheduler[K]) Reserve(ctx context.Context) bool {
	if ctx.Err() != nil || s.stopping.Err() != nil {
		return false
	}
	select {
	case s.buffered <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	case <-s.stopping.Done():
		return false
	}
}

// TryReserve takes room for one message if there is some.
func (s *Scheduler[K]) TryReserve() bool {
	select {
	case s.buffered <- struct{}{}:
		return true
	default:
		return false
	}
}

// Release gives back room for n messages reserved and not enqueued.
func (s *Scheduler[K]) Release(n int) {
	for range n {
		<-s.buffered
	}
}

// Bucket is the lane of key within its group: -1 (the group's own) unless
// Ordering is ByKey, then a bucket of the key among Concurrency (see
// keyBucket).
func (s *Scheduler[K]) Bucket(key []byte) int {
	if s.cfg.Ordering != consumer.ByKey {
		return -1
	}
	return keyBucket(key, s.cfg.Concurrency)
}

// Enqueue appends m, for which room was reserved, to its lane (group k,
// bucket Bucket(m.Key)) and starts a goroutine to drain the lane if fewer
// than Width do. It returns false, and drops m, when the lanes or the
// group stopped.
func (s *Scheduler[K]) Enqueue(k K, m *consumer.Message) bool {
	bucket := s.Bucket(m.Key)
	s.mu.Lock()
	g := s.groups[k]
	if g == nil && !s.stopped {
		g = s.newGroup()
		s.groups[k] = g
	}
	if s.stopped || g.stopping.Err() != nil {
		s.mu.Unlock()
		s.Release(1)
		s.drop(m, s.stopping)
		return false
	}
	l := g.lanes[bucket]
	if l == nil {
		l = &lane{more: make(chan struct{}, 1)}
		g.lanes[bucket] = l
	}
	l.q = append(l.q, m)
	select {
	case l.more <- struct{}{}:
	default:
	}
	if l.drainers < s.width {
		l.drainers++
		s.wg.Add(1)
		g.wg.Add(1)
		go s.drain(g, l)
	}
	s.mu.Unlock()
	return true
}

func (s *Scheduler[K]) newGroup() *group {
	g := &group{lanes: map[int]*lane{}}
	g.stopping, g.stop = context.WithCancel(s.stopping)
	g.run, g.cancel = context.WithCancel(s.run)
	return g
}

// pop appends up to n messages from the head of l to out and gives their
// room in the buffer back. s.mu must be held.
func (s *Scheduler[K]) pop(l *lane, out []*consumer.Message, n int) []*consumer.Message {
	n = min(n, len(l.q)-l.head)
	out = append(out, l.q[l.head:l.head+n]...)
	clear(l.q[l.head : l.head+n])
	l.head += n
	if l.head == len(l.q) {
		l.q, l.head = l.q[:0], 0
	}
	s.Release(n) // never blocks: each message in a lane holds a token
	return out
}

// next appends the lane's next message (or batch) to out; none, and the
// goroutine ends, when the lane is empty or its group stopped (messages
// still queued are dropped by whoever stopped it).
func (s *Scheduler[K]) next(g *group, l *lane, out []*consumer.Message) []*consumer.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	if g.stopping.Err() != nil || l.head == len(l.q) {
		l.drainers--
		return out
	}
	return s.pop(l, out, s.size)
}

// drain runs l's messages until it is empty or g stops: one at a time
// with BatchSize 1; otherwise what is waiting, up to BatchSize, as one
// batch (a lone message runs at once), after BatchLinger.
func (s *Scheduler[K]) drain(g *group, l *lane) {
	defer s.wg.Done()
	defer g.wg.Done()
	r := &runner[K]{s: s, g: g}
	r.waitFn = r.wait
	var batch []*consumer.Message
	if s.size > 1 {
		batch = make([]*consumer.Message, 0, s.size)
	}
	var one [1]*consumer.Message
	for {
		var msgs []*consumer.Message
		if s.size == 1 {
			msgs = s.next(g, l, one[:0])
		} else {
			msgs = s.next(g, l, batch[:0])
		}
		if len(msgs) == 0 {
			return
		}
		if s.cfg.BatchLinger > 0 && len(msgs) < s.size {
			msgs = s.linger(g, l, msgs)
		}
		if s.cfg.Start != nil {
			s.cfg.Start(msgs)
		}
		if len(msgs) == 1 {
			r.one(msgs[0])
		} else {
			r.batch(msgs)
		}
		clear(msgs)
	}
}

// linger waits up to BatchLinger for the batch to fill up.
func (s *Scheduler[K]) linger(g *group, l *lane, batch []*consumer.Message) []*consumer.Message {
	t := time.NewTimer(s.cfg.BatchLinger)
	defer t.Stop()
	for len(batch) < s.size {
		select {
		case <-l.more:
			s.mu.Lock()
			batch = s.pop(l, batch, s.size-len(batch))
			s.mu.Unlock()
		case <-t.C:
			return batch
		case <-g.stopping.Done():
			return batch
		}
	}
	return batch
}

// drop tells Drop of ms.
func (s *Scheduler[K]) drop(m *consumer.Message, stopping context.Context) {
	if s.cfg.Drop != nil {
		s.cfg.Drop(m, context.Cause(stopping))
	}
}

// settle records d for m unless g ended.
func (s *Scheduler[K]) settle(g *group, m *consumer.Message, d consumer.Decision) {
	g.settleMu.RLock()
	defer g.settleMu.RUnlock()
	if !g.ended {
		s.cfg.Settle(m, d)
	}
}

// runner runs one drain goroutine's messages. waitFn is its wait, made
// once.
type runner[K comparable] struct {
	s      *Scheduler[K]
	g      *group
	held   bool // holds a slot
	waitFn func(context.Context, time.Duration) error
}

// take takes one of the Concurrency slots; an error when g is stopping.
func (r *runner[K]) take() error {
	select {
	case r.s.slots <- struct{}{}:
	case <-r.g.stopping.Done():
		return context.Cause(r.g.stopping)
	}
	if err := r.g.stopping.Err(); err != nil {
		<-r.s.slots
		return context.Cause(r.g.stopping)
	}
	r.held = true
	return nil
}

func (r *runner[K]) give() {
	if r.held {
		<-r.s.slots
		r.held = false
	}
}

// wait is the runtime's retry loop's wait (consumer.Processor.Retry): it
// gives the slot back while the message waits for its next attempt, so
// that the other lanes go on, takes one again before the attempt, and
// stops when g stops, without cancelling an attempt in progress (attempts
// run on g.run).
func (r *runner[K]) wait(_ context.Context, d time.Duration) error {
	r.give()
	if err := consumer.Sleep(r.g.stopping, d); err != nil {
		return err
	}
	return r.take()
}

// one runs one message to its end: done, dead-lettered, or stopped.
func (r *runner[K]) one(m *consumer.Message) {
	s, g := r.s, r.g
	if s.cfg.Filter != nil {
		skip, ok := s.cfg.Filter(g.run, g.stopping, m)
		switch {
		case !ok:
			s.drop(m, g.stopping)
			return
		case skip:
			s.settle(g, m, consumer.Decision{Action: consumer.Ack})
			return
		}
	}
	if r.take() != nil {
		s.drop(m, g.stopping)
		return
	}
	d := s.cfg.Proc.ProcessWithRetry(g.run, m, r.waitFn)
	r.give()
	s.settle(g, m, d)
}

// batch runs a lane's batch in order: runs of messages in shared
// transactions (consumer.Processor.ProcessRun), each run's decisions
// settled, and a message to retry retried in place, before the messages
// behind it run. A stop ends the batch after the run in progress; what
// did not run is dropped.
func (r *runner[K]) batch(batch []*consumer.Message) {
	s, g := r.s, r.g
	events := batch
	if s.cfg.Filter != nil {
		// Keep the messages to run, in place.
		events = batch[:0]
		for i, m := range batch {
			skip, ok := s.cfg.Filter(g.run, g.stopping, m)
			switch {
			case !ok:
				r.dropAll(events)
				r.dropAll(batch[i:])
				return
			case skip:
				s.settle(g, m, consumer.Decision{Action: consumer.Ack})
			default:
				events = append(events, m)
			}
		}
	}
	if len(events) == 0 {
		return
	}
	if r.take() != nil {
		r.dropAll(events)
		return
	}
	defer r.give()
	lim := consumer.RunLimits{MaxTime: s.cfg.BatchMaxTime, Stop: g.stopping.Done()}
	for len(events) > 0 && g.stopping.Err() == nil {
		ds := s.cfg.Proc.ProcessRun(g.run, events, lim)
		for i, d := range ds {
			d = s.cfg.Proc.Retry(g.run, events[i], d, r.waitFn)
			s.settle(g, events[i], d)
			if d.Action != consumer.Ack {
				r.dropAll(events[i+1:]) // stopped: the rest does not run
				return
			}
		}
		events = events[len(ds):]
	}
	r.dropAll(events)
}

func (r *runner[K]) dropAll(ms []*consumer.Message) {
	for _, m := range ms {
		r.s.drop(m, r.g.stopping)
	}
}
