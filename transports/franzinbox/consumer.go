package franzinbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/transports/internal/keylane"
	"github.com/justonce/justonce/transports/internal/offsets"
)

// Consumer is one member of a Kafka consumer group whose handler runs once
// per event ID. Create it with New and start it with Run.
type Consumer struct {
	cfg    Config
	h      consumer.Handler
	userDL bool // Processor.DeadLetter was given
	proc   *consumer.Processor
	log    *slog.Logger
	client atomic.Pointer[kgo.Client] // Run's client, which produces dead letters
	ran    atomic.Bool
}

// errNotRunning is a dead letter's error before Run has a client (never
// seen in practice: messages are fetched by that client).
var errNotRunning = errors.New("justonce/franzinbox: the consumer is not running")

// New returns a Consumer that runs h for each new event of cfg.Topics.
// It validates cfg and applies the defaults; it does not connect: Run does.
//
//	c, err := franzinbox.New(franzinbox.Config{
//		Brokers:   []string{"localhost:9092"},
//		Topics:    []string{"orders"},
//		GroupID:   "billing",
//		Processor: consumer.Config{Ledger: ledger},
//	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
//		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
//		return err
//	})
func New(cfg Config, h consumer.Handler) (*Consumer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	c := &Consumer{cfg: cfg, h: h, userDL: cfg.Processor.DeadLetter != nil}
	if !c.userDL {
		cfg.Processor.DeadLetter = c.deadLetterTo(func() *kgo.Client { return c.client.Load() })
	}
	p, err := consumer.New(cfg.Processor, h)
	if err != nil {
		return nil, err
	}
	c.proc = p
	c.cfg.Processor = p.Config()
	c.log = cfg.Processor.Ledger.Logger()
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	return c, nil
}

// Config returns the configuration with defaults applied.
func (c *Consumer) Config() Config { return c.cfg }

// deadLetterTo publishes to the message's dead-letter topic through the
// client client returns, with the dead-letter headers, and waits for all
// in-sync replicas to have it.
func (c *Consumer) deadLetterTo(client func() *kgo.Client) func(context.Context, *consumer.Message, error) error {
	return func(ctx context.Context, m *consumer.Message, cause error) error {
		cl := client()
		if cl == nil {
			return errNotRunning
		}
		return cl.ProduceSync(ctx, &kgo.Record{
			Topic:   c.cfg.deadLetterTopic(m.Topic),
			Key:     m.Key,
			Value:   m.Value,
			Headers: toRecordHeaders(consumer.DeadLetterHeadersContext(ctx, c.cfg.Processor.Scope, m, cause)),
		}).FirstErr()
	}
}

// baseOptions are the client options every client of the Consumer starts
// from: the brokers, the defaults, the user's options.
func (c *Consumer) baseOptions() []kgo.Opt {
	opts := []kgo.Opt{
		kgo.SeedBrokers(c.cfg.Brokers...),
		kgo.SessionTimeout(DefaultSessionTimeout),
		kgo.RebalanceTimeout(DefaultRebalanceTimeout),
		kgo.HeartbeatInterval(DefaultHeartbeatInterval),
		kgo.FetchMaxWait(time.Second),
		kgo.AllowAutoTopicCreation(), // dead-letter topics, where the brokers allow it
		kgo.WithLogger(kgoLogger{c.log}),
	}
	opts = append(opts, c.cfg.ClientOptions...)
	return append(opts, kgo.SeedBrokers(c.cfg.Brokers...))
}

// clientOptions are the group consumer's options: baseOptions, then what
// the Consumer needs.
func (c *Consumer) clientOptions(s *session) []kgo.Opt {
	return append(c.baseOptions(),
		kgo.ConsumerGroup(c.cfg.GroupID),
		kgo.ConsumeTopics(c.cfg.Topics...),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		// Transaction markers come too, to be marked done at once: the
		// committed offset then moves past a partition's last marker (and
		// the aborted records before it), and the group shows no lag.
		kgo.KeepControlRecords(),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.OnPartitionsRevoked(s.revoked(true)),
		kgo.OnPartitionsLost(s.revoked(false)),
	)
}

// Run consumes until ctx is done, then shuts down as every front does (see
// the consumer package, "Fronts"): it stops polling, lets the attempts in
// flight finish (up to Config.ShutdownTimeout; fetched messages not yet
// started are left for redelivery), commits the offsets of what is done,
// and leaves the group. It returns nil after such a stop; an error only
// when the client cannot be configured. A second call returns
// consumer.ErrRunOnce.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.ran.CompareAndSwap(false, true) {
		return consumer.ErrRunOnce
	}
	s := c.newSession(ctx)
	cl, err := kgo.NewClient(c.clientOptions(s)...)
	if err != nil {
		return fmt.Errorf("justonce/franzinbox: client config: %w", err)
	}
	s.cl = cl
	c.client.Store(cl)
	s.run(ctx)
	return nil
}

// session is one Run: the client, the partitions with their lanes of
// messages waiting to run, and the commit watermark.
//
// Each lane holds the messages that must run one after the other (one
// partition, or one key bucket of a partition with ByKey) and is drained
// by at most one goroutine, which runs them in order. An attempt takes one
// of Config.Concurrency slots while it runs and gives it back while the
// runtime's retry loop waits (inSlot): a message waiting to be retried
// holds up its own lane only, and the other lanes go on. The poll loop
// stops polling only when Config.MaxBuffered messages are waiting in the
// lanes.
type session struct {
	c        *Consumer
	cl       *kgo.Client
	tr       *offsets.Tracker[topicPartition]
	stopping context.Context    // ends when Run's context ends: no new attempts
	stop     context.CancelFunc // ends stopping
	procCtx  context.Context
	cancel   context.CancelFunc // cancels procCtx

	buffered chan struct{} // a token per message polled and not yet taken from its lane
	slots    chan struct{} // a token per attempt running
	lanesWG  sync.WaitGroup
	commitMu sync.Mutex // one commit at a time: a later one never rewinds an earlier

	mu    sync.Mutex
	parts map[topicPartition]*part
}

// topicPartition names one partition.
type topicPartition struct {
	topic     string
	partition int32
}

// part is one assigned partition: its lanes and the contexts its attempts
// run under. Fields other than the contexts are guarded by session.mu.
type part struct {
	stopping context.Context    // ends when Run stops or the partition is revoked
	stop     context.CancelFunc // ends stopping
	ctx      context.Context    // attempts run on it
	cancel   context.CancelFunc // cancels ctx: rolls the attempts back
	lanes    map[int]*lane      // by key bucket; -1: the partition's own
	wg       sync.WaitGroup     // lane goroutines
	ended    bool               // revoked or lost, and forgotten; guarded by session.mu
}

// lane is the queue of messages that run in order. Fields other than more
// are guarded by session.mu.
type lane struct {
	msgs    []*consumer.Message
	running bool          // a goroutine drains it
	more    chan struct{} // signalled when a message is added (batch linger)
}

func (c *Consumer) newSession(ctx context.Context) *session {
	// Handlers run on a context that keeps ctx's values but not its
	// cancellation, so that in-flight work finishes at shutdown.
	procCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stopping, stop := context.WithCancel(context.WithoutCancel(ctx))
	return &session{
		c:        c,
		tr:       offsets.NewTracker[topicPartition](),
		stopping: stopping,
		stop:     stop,
		procCtx:  procCtx,
		cancel:   cancel,
		buffered: make(chan struct{}, max(c.cfg.MaxBuffered, c.cfg.BatchSize)),
		slots:    make(chan struct{}, c.cfg.Concurrency),
		parts:    map[topicPartition]*part{},
	}
}

func (s *session) run(ctx context.Context) {
	defer s.cancel()
	cfg := s.c.cfg
	commitCtx, stopCommits := context.WithCancel(s.procCtx)
	committerDone := make(chan struct{})
	go func() {
		defer close(committerDone)
		s.commitLoop(commitCtx)
	}()

	s.poll(ctx)

	// Shutdown: no new attempts; wait for in-flight ones. The poll loop
	// has returned, so no lane starts after this.
	s.stop()
	lanesDone := make(chan struct{})
	go func() {
		s.lanesWG.Wait()
		close(lanesDone)
	}()
	grace := time.NewTimer(cfg.ShutdownTimeout)
	select {
	case <-lanesDone:
		grace.Stop()
	case <-grace.C:
		s.c.log.WarnContext(ctx, "justonce franz: in-flight handlers still running after the shutdown timeout; cancelling them", "timeout", cfg.ShutdownTimeout)
		s.cancel()
		<-lanesDone
	}
	stopCommits()
	<-committerDone

	final, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
	s.commit(final, s.cl, nil)
	cancel()
	// Leaving the group revokes every partition: the revoke callback finds
	// the lanes stopped and nothing more to commit.
	s.cl.CloseAllowingRebalance()
}

// poll hands polled records to their lanes until ctx is done.
//
// The client blocks rebalances from a poll until AllowRebalance
// (kgo.BlockRebalanceOnPoll), which the loop calls as soon as the records
// are in their lanes: the revoke callback, which runs between two polls,
// then finds every record of a revoked partition in a lane of its own,
// and no later poll returns one.
func (s *session) poll(ctx context.Context) {
	failing := false
	for {
		// Room first: a full buffer holds the poll, never a record already
		// taken from the client.
		select {
		case s.buffered <- struct{}{}:
		case <-ctx.Done():
			return
		}
		room := 1
	more:
		for room < cap(s.buffered) {
			select {
			case s.buffered <- struct{}{}:
				room++
			default:
				break more
			}
		}
		fs := s.cl.PollRecords(ctx, room)
		got := 0
		fs.EachRecord(func(r *kgo.Record) {
			if r.Attrs.IsControl() {
				// A transaction marker: nothing to run.
				tp := topicPartition{r.Topic, r.Partition}
				s.tr.Fetched(tp, r.Offset)
				s.tr.Done(tp, r.Offset)
				return
			}
			got++
			s.enqueue(r)
		})
		s.cl.AllowRebalance()
		for range room - got {
			<-s.buffered
		}
		if ctx.Err() != nil || fs.IsClientClosed() {
			return
		}
		var errs []error
		for _, fe := range fs.Errors() {
			if !errors.Is(fe.Err, context.Canceled) {
				errs = append(errs, fmt.Errorf("%s/%d: %w", fe.Topic, fe.Partition, fe.Err))
			}
		}
		if len(errs) == 0 {
			failing = false
			continue
		}
		if !failing {
			s.c.log.WarnContext(ctx, "justonce franz: fetch failed, retrying", "topics", s.c.cfg.Topics, "err", errors.Join(errs...))
			failing = true
		}
		if got == 0 && consumer.Sleep(ctx, 500*time.Millisecond) != nil {
			return
		}
	}
}

// enqueue appends r to its lane, the partition's or with ByKey (and
// Concurrency > 1) a bucket of its key within the partition, and starts the
// lane's goroutine if none runs.
func (s *session) enqueue(r *kgo.Record) {
	tp := topicPartition{r.Topic, r.Partition}
	bucket := -1
	if s.c.cfg.Ordering == ByKey {
		bucket = keylane.Of(r.Key, s.c.cfg.Concurrency)
	}
	s.tr.Fetched(tp, r.Offset)
	m := fromRecord(r)

	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.parts[tp]
	if p == nil {
		p = &part{lanes: map[int]*lane{}}
		p.stopping, p.stop = context.WithCancel(s.stopping)
		p.ctx, p.cancel = context.WithCancel(s.procCtx)
		s.parts[tp] = p
	}
	l := p.lanes[bucket]
	if l == nil {
		l = &lane{more: make(chan struct{}, 1)}
		p.lanes[bucket] = l
	}
	l.msgs = append(l.msgs, m)
	select {
	case l.more <- struct{}{}:
	default:
	}
	if !l.running {
		l.running = true
		s.lanesWG.Add(1)
		p.wg.Add(1)
		go s.drain(p, l)
	}
}

// pop takes up to n messages from the head of l. s.mu must be held.
func (s *session) pop(l *lane, n int) []*consumer.Message {
	n = min(n, len(l.msgs))
	if n == 0 {
		return nil
	}
	out := make([]*consumer.Message, n)
	copy(out, l.msgs)
	clear(l.msgs[:n])
	l.msgs = l.msgs[n:]
	if len(l.msgs) == 0 {
		l.msgs = nil
	}
	for range n {
		<-s.buffered // never blocks: each message in a lane holds a token
	}
	return out
}

// next takes the lane's next message (or batch); nil, and the lane's
// goroutine ends, when the lane is empty, the consumer is stopping or the
// partition was revoked (messages still queued are left pending).
func (s *session) next(p *part, l *lane, n int) []*consumer.Message {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.stopping.Err() != nil || len(l.msgs) == 0 {
		l.running = false
		return nil
	}
	return s.pop(l, n)
}

// drain runs l's messages in order until it is empty, the consumer stops or
// the partition is revoked: one at a time with BatchSize 1; otherwise what
// is waiting in the lane, up to BatchSize, as one batch (a lone message
// runs at once).
func (s *session) drain(p *part, l *lane) {
	defer s.lanesWG.Done()
	defer p.wg.Done()
	size := max(1, s.c.cfg.BatchSize)
	for {
		msgs := s.next(p, l, size)
		if msgs == nil {
			return
		}
		if size == 1 {
			s.handle(p, msgs[0])
			continue
		}
		if s.c.cfg.BatchLinger > 0 {
			msgs = s.linger(p, l, msgs, size)
		}
		s.handleBatch(p, msgs)
	}
}

// linger waits up to BatchLinger for the batch to fill up.
func (s *session) linger(p *part, l *lane, batch []*consumer.Message, size int) []*consumer.Message {
	if len(batch) >= size {
		return batch
	}
	t := time.NewTimer(s.c.cfg.BatchLinger)
	defer t.Stop()
	for len(batch) < size {
		select {
		case <-l.more:
			s.mu.Lock()
			batch = append(batch, s.pop(l, size-len(batch))...)
			s.mu.Unlock()
		case <-t.C:
			return batch
		case <-p.stopping.Done():
			return batch
		}
	}
	return batch
}

// take takes one of the Concurrency slots; an error when the consumer is
// stopping or p was revoked.
func (s *session) take(p *part) error {
	select {
	case s.slots <- struct{}{}:
	case <-p.stopping.Done():
		return context.Cause(p.stopping)
	}
	if err := p.stopping.Err(); err != nil {
		<-s.slots
		return err
	}
	return nil
}

// inSlot runs f holding one of the Concurrency slots, and does nothing
// when the consumer is stopping or p was revoked. f gets the wait to give
// the runtime's retry loop (consumer.Processor.Retry): it gives the slot
// back while the message waits for its next attempt, so that the other
// lanes go on, takes one again before the attempt, and stops when the
// consumer stops or p is revoked, without cancelling an attempt in
// progress (attempts run on p.ctx).
func (s *session) inSlot(p *part, f func(wait func(context.Context, time.Duration) error)) {
	if s.take(p) != nil {
		return
	}
	held := true
	defer func() {
		if held {
			<-s.slots
		}
	}()
	f(func(_ context.Context, d time.Duration) error {
		<-s.slots
		held = false
		if err := consumer.Sleep(p.stopping, d); err != nil {
			return err
		}
		if err := s.take(p); err != nil {
			return err
		}
		held = true
		return nil
	})
}

// handle runs one message to its end: done, dead-lettered, or stopped.
func (s *session) handle(p *part, m *consumer.Message) {
	s.inSlot(p, func(wait func(context.Context, time.Duration) error) {
		s.settle(p, m, s.c.proc.ProcessWithRetry(p.ctx, m, wait))
	})
}

// handleBatch runs a lane's batch in order: runs of messages in shared
// transactions (consumer.Processor.ProcessRun), each run's decisions
// settled, and a message to retry retried in place, before the messages
// behind it run. Offsets not done (and every later one of their partition)
// stay uncommitted. A revoke or a stop ends the batch after the run in
// progress.
func (s *session) handleBatch(p *part, events []*consumer.Message) {
	s.inSlot(p, func(wait func(context.Context, time.Duration) error) {
		for len(events) > 0 && p.stopping.Err() == nil {
			ds := s.c.proc.ProcessRun(p.ctx, events, consumer.RunLimits{MaxTime: s.c.cfg.BatchMaxTime, Stop: p.stopping.Done()})
			for i, d := range ds {
				d = s.c.proc.Retry(p.ctx, events[i], d, wait)
				s.settle(p, events[i], d)
				if d.Action != consumer.Ack {
					return // stopped: this one and the rest stay pending
				}
			}
			events = events[len(ds):]
		}
	})
}

// settle marks an acked message done for the commit watermark. A stopped
// one stays pending: its offset is never committed by this member. So
// does a message of an assignment that ended (p.ended): a handler left
// running after a revoke must not mark an offset done in a later
// assignment of the partition, whose tracking restarted below it, or the
// watermark would pass messages not yet run.
func (s *session) settle(p *part, m *consumer.Message, d consumer.Decision) {
	if d.Action != consumer.Ack {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !p.ended {
		s.tr.Done(topicPartition{m.Topic, int32(m.Partition)}, m.Offset)
	}
}

// ended marks the parts of an assignment that ended, once the tracker has
// forgotten their partitions (before the partitions can be assigned again:
// the revoke callback has not returned yet).
func (s *session) ended(ps []*part) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range ps {
		p.ended = true
	}
}

// revoked returns the callback for partitions taken from this member: by
// a rebalance (commit true: kgo.OnPartitionsRevoked) or because the
// member was dropped from the group (commit false: kgo.OnPartitionsLost,
// when a commit cannot succeed).
//
// No new attempt starts for those partitions and their queued messages
// are dropped.
//
// Revoked: the callback waits for the attempts in flight, up to half the
// rebalance timeout, then cancels them (rolled back, they come again to
// the new owner) and waits for them to return, commits what is done and
// forgets the partitions. The group hands them to another member only
// after the callback returns, so two members never run one partition's
// messages at the same time, unless a handler ignores the cancellation
// past the rebalance timeout: the group then drops this member and moves
// the partitions while the handler runs, and the ledger absorbs it (the
// new owner gets InFlight until the old attempt ends, then Duplicate or a
// fresh claim).
//
// Lost: another member may own the partitions already, and no commit of
// this member's can succeed. The callback forgets them at once, after the
// commit in progress if any, so the commit loop sends nothing more of
// theirs (an attempt that ends later is not recorded: offsets.Tracker
// ignores a forgotten partition), cancels their attempts in flight at
// once (rolled back, they come again to the new owner, which would
// otherwise get InFlight until they end) and waits for them to return:
// the member rejoins only after the callback returns. An old attempt that
// ignores its cancellation may still run then: what it settles is not
// recorded (settle), so the partition's next assignment here commits only
// what that assignment ran.
func (s *session) revoked(commit bool) func(context.Context, *kgo.Client, map[string][]int32) {
	return func(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
		gone := map[topicPartition]bool{}
		var ps []*part
		running := 0 // lanes with a message in hand
		s.mu.Lock()
		for topic, partitions := range lost {
			for _, n := range partitions {
				tp := topicPartition{topic, n}
				gone[tp] = true
				p := s.parts[tp]
				if p == nil {
					continue
				}
				delete(s.parts, tp)
				p.stop()
				for _, l := range p.lanes {
					if l.running {
						running++
					}
					for range l.msgs {
						<-s.buffered
					}
					l.msgs = nil
				}
				ps = append(ps, p)
			}
		}
		s.mu.Unlock()
		if len(gone) == 0 {
			return
		}
		if !commit {
			s.forget(gone)
			s.ended(ps)
			for _, p := range ps {
				p.cancel()
			}
		}
		s.c.log.Debug("justonce franz: partitions revoked; waiting for their handlers in flight",
			"partitions", len(gone), "lost", !commit, "lanes_running", running)

		budget := DefaultRebalanceTimeout
		if d, ok := cl.OptValue(kgo.RebalanceTimeout).(time.Duration); ok && d > 0 {
			budget = d
		}
		done := make(chan struct{})
		go func() {
			for _, p := range ps {
				p.wg.Wait()
			}
			close(done)
		}()
		if !commit {
			s.waitCancelled(done) // cancelled above; forgotten already
			return
		}
		t := time.NewTimer(budget / 2)
		select {
		case <-done:
			t.Stop()
		case <-t.C:
			s.c.log.Warn("justonce franz: handlers of revoked partitions still running; cancelling them", "waited", budget/2)
			for _, p := range ps {
				p.cancel()
			}
			s.waitCancelled(done)
		}
		for _, p := range ps {
			p.cancel()
		}
		ctx, cancel := context.WithTimeout(context.Background(), budget/4)
		s.commitAndForget(ctx, cl, gone)
		cancel()
		s.ended(ps)
	}
}

// waitCancelled waits a second for cancelled handlers of revoked
// partitions (done). A handler that ignores its cancellation would hold
// the revoke, and so the whole group's rebalance: it is left running. The
// commit after the revoke stops below its message, which the partition's
// next owner reads again; if it returns success later its transaction
// still commits (the ledger commits on a context of its own) and its
// effect still happens once, since the next run of its message waits for
// the key's lock and then finds the key done. Run waits for it (lanesWG)
// before it returns.
func (s *session) waitCancelled(done <-chan struct{}) {
	select {
	case <-done:
	case <-time.After(time.Second):
		s.c.log.Error("justonce franz: handlers of revoked partitions ignore their cancellation; leaving them behind at the rebalance")
	}
}

// commitLoop commits the watermark every CommitInterval until ctx is done.
func (s *session) commitLoop(ctx context.Context) {
	t := time.NewTicker(s.c.cfg.CommitInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.commit(ctx, s.cl, nil)
		}
	}
}

// commitAndForget commits what is done of the partitions in gone and
// forgets them, in one step: no other commit comes in between, so none of
// the commit loop's can land after it.
func (s *session) commitAndForget(ctx context.Context, cl *kgo.Client, gone map[topicPartition]bool) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.commitLocked(ctx, cl, gone)
	s.tr.Forget(gone)
}

// forget forgets the partitions in gone without committing them, after
// the commit in progress if any: no commit of theirs is sent after it.
func (s *session) forget(gone map[topicPartition]bool) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.tr.Forget(gone)
}

// commit commits, for each partition (of only, when not nil), the offset
// below which everything is done. A failed commit (a broker away, the
// group rebalancing) is logged and tried again next time: the offsets stay
// where they were, so messages may come again, and the ledger skips them.
func (s *session) commit(ctx context.Context, cl *kgo.Client, only map[topicPartition]bool) {
	s.commitMu.Lock()
	defer s.commitMu.Unlock()
	s.commitLocked(ctx, cl, only)
}

// commitLocked is commit with s.commitMu held.
func (s *session) commitLocked(ctx context.Context, cl *kgo.Client, only map[topicPartition]bool) {
	offs := s.tr.Committable(only)
	if len(offs) == 0 {
		return
	}
	req := map[string]map[int32]kgo.EpochOffset{}
	for tp, next := range offs {
		if req[tp.topic] == nil {
			req[tp.topic] = map[int32]kgo.EpochOffset{}
		}
		req[tp.topic][tp.partition] = kgo.EpochOffset{Epoch: -1, Offset: next}
	}
	ok := map[topicPartition]int64{}
	var errs []error
	cl.CommitOffsetsSync(ctx, req, func(_ *kgo.Client, _ *kmsg.OffsetCommitRequest, resp *kmsg.OffsetCommitResponse, err error) {
		if err != nil {
			errs = append(errs, err)
			return
		}
		for _, t := range resp.Topics {
			for _, p := range t.Partitions {
				tp := topicPartition{t.Topic, p.Partition}
				if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
					errs = append(errs, fmt.Errorf("%s/%d: %w", t.Topic, p.Partition, err))
					continue
				}
				if off, found := offs[tp]; found {
					ok[tp] = off
				}
			}
		}
	})
	s.tr.Committed(ok)
	if len(errs) > 0 && ctx.Err() == nil {
		s.c.log.WarnContext(ctx, "justonce franz: offset commit failed; will retry (redelivered messages are deduplicated)", "group", s.c.cfg.GroupID, "err", errors.Join(errs...))
	}
}

// kgoLogger passes franz-go's log lines to the ledger's logger, from Info
// up when that is enabled, else from Warn.
type kgoLogger struct{ log *slog.Logger }

func (l kgoLogger) Level() kgo.LogLevel {
	switch {
	case l.log.Enabled(context.Background(), slog.LevelInfo):
		return kgo.LogLevelInfo
	case l.log.Enabled(context.Background(), slog.LevelWarn):
		return kgo.LogLevelWarn
	}
	return kgo.LogLevelError
}

func (l kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	lv := slog.LevelInfo
	switch level {
	case kgo.LogLevelError:
		lv = slog.LevelError
	case kgo.LogLevelWarn:
		lv = slog.LevelWarn
	case kgo.LogLevelDebug:
		lv = slog.LevelDebug
	}
	l.log.Log(context.Background(), lv, "justonce franz: franz-go: "+msg, keyvals...)
}
