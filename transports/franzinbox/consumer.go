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
	"github.com/justonce/justonce/transports/internal/front"
	"github.com/justonce/justonce/transports/internal/kafkarec"
	"github.com/justonce/justonce/transports/internal/lanes"
	"github.com/justonce/justonce/transports/internal/offsets"
)

// Consumer is one member of a Kafka consumer group whose handler runs once
// per event ID. Create it with New and start it with Run.
type Consumer struct {
	front.Front
	cfg    Config
	client atomic.Pointer[kgo.Client] // Run's client, which produces dead letters
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
	c := &Consumer{cfg: cfg.withDefaults()}
	pc, err := c.Init(c.cfg.Processor, h, func() front.DeadLetter {
		return c.deadLetterTo(func() *kgo.Client { return c.client.Load() })
	})
	if err != nil {
		return nil, err
	}
	c.cfg.Processor = pc
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
			Headers: kafkarec.Headers[kgo.RecordHeader](consumer.DeadLetterHeadersContext(ctx, c.cfg.Processor.Scope, m, cause)),
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
		kgo.WithLogger(kgoLogger{c.Log}),
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
// when the client cannot be configured, or when a topic outlives the
// ledger under consumer.HorizonRefuse (a *consumer.HorizonError, before
// the group is joined; see consumer.Config.Horizon). A second call returns
// consumer.ErrRunOnce.
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.Started(); err != nil {
		return err
	}
	// Before the group client exists: a refusal consumes nothing.
	if err := c.checkHorizon(ctx); err != nil {
		return err
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

// session is one Run: the client, the lanes of messages waiting to run
// (lanes.Scheduler: a lane per partition, or per key bucket of a partition
// with ByKey; a partition's lanes stop together when it is revoked), and
// the commit watermark. The poll loop stops polling only when
// Config.MaxBuffered messages are waiting in the lanes.
type session struct {
	c        *Consumer
	cl       *kgo.Client
	tr       *offsets.Tracker[topicPartition]
	lanes    *lanes.Scheduler[topicPartition]
	commitMu sync.Mutex // one commit at a time: a later one never rewinds an earlier
}

// topicPartition names one partition.
type topicPartition struct {
	topic     string
	partition int32
}

func (c *Consumer) newSession(ctx context.Context) *session {
	s := &session{c: c, tr: offsets.NewTracker[topicPartition]()}
	// Handlers run on a context that keeps ctx's values but not its
	// cancellation, so that in-flight work finishes at shutdown; the
	// lanes stop when the session stops them, a partition's when it is
	// revoked.
	s.lanes = lanes.New[topicPartition](context.WithoutCancel(ctx), ctx, lanes.Config{
		Scheduling: c.cfg.Scheduling,
		Buffer:     max(c.cfg.MaxBuffered, c.cfg.BatchSize),
		Proc:       c.Proc,
		Settle:     s.settle,
		Log:        c.Log,
		Name:       "justonce franz",
	})
	return s
}

func (s *session) run(ctx context.Context) {
	defer s.lanes.Cancel()
	cfg := s.c.cfg
	commitCtx, stopCommits := context.WithCancel(s.lanes.Context())
	committerDone := make(chan struct{})
	go func() {
		defer close(committerDone)
		s.commitLoop(commitCtx)
	}()

	s.poll(ctx)

	// Shutdown: no new attempts; wait for in-flight ones. The poll loop
	// has returned, so no lane starts after this.
	s.lanes.Stop()
	s.lanes.Await(lanes.Wait{Grace: cfg.ShutdownTimeout, What: "in-flight handlers", Why: "shutdown"})
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
		if !s.lanes.Reserve(ctx) {
			return
		}
		room := 1
		for room < s.lanes.Cap() && s.lanes.TryReserve() {
			room++
		}
		fs := s.cl.PollRecords(ctx, room)
		got := 0
		fs.EachRecord(func(r *kgo.Record) {
			tp := topicPartition{r.Topic, r.Partition}
			s.tr.Fetched(tp, r.Offset)
			if r.Attrs.IsControl() {
				// A transaction marker: nothing to run.
				s.tr.Done(tp, r.Offset)
				return
			}
			got++
			s.lanes.Enqueue(tp, fromRecord(r))
		})
		s.cl.AllowRebalance()
		s.lanes.Release(room - got)
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
			s.c.Log.WarnContext(ctx, "justonce franz: fetch failed, retrying", "topics", s.c.cfg.Topics, "err", errors.Join(errs...))
			failing = true
		}
		if got == 0 && consumer.Sleep(ctx, 500*time.Millisecond) != nil {
			return
		}
	}
}

// settle marks an acked message done for the commit watermark. A stopped
// one stays pending: its offset is never committed by this member. So
// does a message of an assignment that ended (the scheduler passes over
// the settles of a revoked partition's lanes once the revoke ended them):
// a handler left running after a revoke must not mark an offset done in a
// later assignment of the partition, whose tracking restarted below it, or
// the watermark would pass messages not yet run.
func (s *session) settle(m *consumer.Message, d consumer.Decision) {
	if d.Action == consumer.Ack {
		s.tr.Done(topicPartition{m.Topic, int32(m.Partition)}, m.Offset)
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
// recorded (Revoked.End), so the partition's next assignment here commits
// only what that assignment ran.
//
// A handler that ignores its cancellation for a second after it is
// cancelled would hold the revoke, and so the whole group's rebalance: it
// is left running. The commit after the revoke stops below its message,
// which the partition's next owner reads again. Run waits for it before
// it returns.
func (s *session) revoked(commit bool) func(context.Context, *kgo.Client, map[string][]int32) {
	return func(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
		gone := map[topicPartition]bool{}
		var tps []topicPartition
		for topic, partitions := range lost {
			for _, n := range partitions {
				tp := topicPartition{topic, n}
				gone[tp] = true
				tps = append(tps, tp)
			}
		}
		if len(gone) == 0 {
			return
		}
		rv := s.lanes.Revoke(tps)
		if !commit {
			s.forget(gone)
			rv.End()
		}
		s.c.Log.Debug("justonce franz: partitions revoked; waiting for their handlers in flight",
			"partitions", len(gone), "lost", !commit, "lanes_running", rv.Running())

		budget := DefaultRebalanceTimeout
		if d, ok := cl.OptValue(kgo.RebalanceTimeout).(time.Duration); ok && d > 0 {
			budget = d
		}
		const what = "handlers of revoked partitions"
		if !commit {
			rv.Await(lanes.Wait{What: what, Rebalance: true}) // cancelled at once; forgotten already
			return
		}
		rv.Await(lanes.Wait{Grace: budget / 2, What: what, Rebalance: true})
		ctx, cancel := context.WithTimeout(context.Background(), budget/4)
		s.commitAndForget(ctx, cl, gone)
		cancel()
		rv.End()
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
		s.c.Log.WarnContext(ctx, "justonce franz: offset commit failed; will retry (redelivered messages are deduplicated)", "group", s.c.cfg.GroupID, "err", errors.Join(errs...))
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
