package kafkainbox

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

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
	cfg       Config
	writer    *kafka.Writer // dead letters; nil when Processor.DeadLetter was given
	ownWriter bool
	leftover  sync.WaitGroup // handlers left behind at a rebalance
}

// New returns a Consumer that runs h for each new event of cfg.Topic.
// It validates cfg and applies the defaults; it does not connect: Run does.
//
//	c, err := kafkainbox.New(kafkainbox.Config{
//		Brokers:   []string{"localhost:9092"},
//		Topic:     "orders",
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
		c.writer, c.ownWriter = c.deadLetterWriter()
		return c.deadLetterTo(c.writer)
	})
	if err != nil {
		return nil, err
	}
	c.cfg.Processor = pc
	return c, nil
}

// Config returns the configuration with defaults applied.
func (c *Consumer) Config() Config { return c.cfg }

// deadLetterWriter returns Config.DeadLetterWriter, or a new writer that
// the caller owns (and must close).
func (c *Consumer) deadLetterWriter() (w *kafka.Writer, owned bool) {
	if c.cfg.DeadLetterWriter != nil {
		return c.cfg.DeadLetterWriter, false
	}
	return &kafka.Writer{
		Addr:                   kafka.TCP(c.cfg.Brokers...),
		Balancer:               &kafka.Hash{},
		RequiredAcks:           kafka.RequireAll,
		BatchSize:              1, // each dead letter is written at once
		AllowAutoTopicCreation: true,
		Transport:              &kafka.Transport{},
	}, true
}

// deadLetterTo publishes to the dead-letter topic through w, with the
// dead-letter headers, and waits for all in-sync replicas to have it.
func (c *Consumer) deadLetterTo(w *kafka.Writer) func(context.Context, *consumer.Message, error) error {
	return func(ctx context.Context, m *consumer.Message, cause error) error {
		return w.WriteMessages(ctx, kafka.Message{
			Topic:   c.cfg.DeadLetterTopic,
			Key:     m.Key,
			Value:   m.Value,
			Headers: kafkarec.Headers[kafka.Header](consumer.DeadLetterHeadersContext(ctx, c.cfg.Processor.Scope, m, cause)),
		})
	}
}

func (c *Consumer) readerConfig() kafka.ReaderConfig {
	rc := kafka.ReaderConfig{
		MaxWait:           time.Second,
		SessionTimeout:    DefaultSessionTimeout,
		RebalanceTimeout:  DefaultRebalanceTimeout,
		HeartbeatInterval: DefaultHeartbeatInterval,
		JoinGroupBackoff:  DefaultJoinGroupBackoff,
		QueueCapacity:     max(100, 2*c.cfg.BatchSize),
		// A partition reader (not a group reader) would otherwise open a
		// connection to the partition's leader every minute to read its
		// lag, which nothing here uses.
		ReadLagInterval: -1,
		ErrorLogger: kafka.LoggerFunc(func(format string, args ...any) {
			if c.Log.Enabled(context.Background(), slog.LevelWarn) {
				c.Log.Warn("justonce kafka: kafka-go: " + fmt.Sprintf(format, args...))
			}
		}),
	}
	if c.cfg.Reader != nil {
		c.cfg.Reader(&rc)
	}
	rc.Brokers = c.cfg.Brokers
	rc.Topic = c.cfg.Topic
	rc.GroupTopics = nil
	rc.GroupID = c.cfg.GroupID
	rc.Partition = 0
	rc.CommitInterval = 0 // the Consumer commits, after the ledger did
	return rc
}

// Run consumes until ctx is done, then shuts down as every front does (see
// the consumer package, "Fronts"): it stops fetching, lets the attempts in
// flight finish (up to Config.ShutdownTimeout; fetched messages not yet
// started are left for redelivery), commits the offsets of what is done,
// and leaves the group. It returns nil after such a stop; an error only
// when the reader cannot be configured. A second call returns
// consumer.ErrRunOnce.
//
// A rebalance ends the group's generation, and with it every partition
// this member holds: the Consumer stops the same way (in-flight attempts
// get up to the least of ShutdownTimeout and half the rebalance and
// session timeouts), commits what is done under the ending generation,
// and only then rejoins.
// A commit of that generation that comes later is refused by the group
// coordinator, so an offset never moves back below what the partition's
// next owner committed.
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.Started(); err != nil {
		return err
	}
	defer c.closeWriter()
	rc := c.readerConfig()
	if err := rc.Validate(); err != nil {
		return fmt.Errorf("justonce/kafkainbox: reader config: %w", err)
	}
	gc := groupConfig(rc)
	if err := gc.Validate(); err != nil { // also fills in kafka-go's defaults
		return fmt.Errorf("justonce/kafkainbox: group config: %w", err)
	}
	ctl := newControlChecker(rc.Brokers, rc.Dialer)
	defer ctl.close()
	// Before the group is joined: a refusal consumes nothing.
	if err := c.checkHorizon(ctx, ctl.client, rc.StartOffset == kafka.LastOffset); err != nil {
		return err
	}
	group, err := kafka.NewConsumerGroup(gc)
	if err != nil {
		return fmt.Errorf("justonce/kafkainbox: group config: %w", err)
	}
	// At a rebalance the member sends no heartbeats until it rejoins, and
	// the coordinator waits for it at most the rebalance timeout and drops
	// it after the session timeout: in-flight attempts get half the lesser.
	rebalanceGrace := min(c.cfg.ShutdownTimeout, gc.RebalanceTimeout/2, gc.SessionTimeout/2)
	failing := false
	for ctx.Err() == nil {
		gen, err := group.Next(ctx)
		if err != nil {
			if ctx.Err() == nil && !failing {
				c.Log.WarnContext(ctx, "justonce kafka: joining the group failed, retrying", "group", c.cfg.GroupID, "err", err)
				failing = true
			}
			continue // kafka-go waits JoinGroupBackoff before it tries again
		}
		failing = false
		c.runGeneration(ctx, gen, rc, ctl, rebalanceGrace)
	}
	// Leaves the group; the last generation's session has committed.
	if err := group.Close(); err != nil {
		c.Log.WarnContext(ctx, "justonce kafka: leaving the group", "group", c.cfg.GroupID, "err", err)
	}
	// Handlers left behind at a rebalance were cancelled; return once
	// they have.
	c.leftover.Wait()
	return nil
}

// runGeneration consumes the partitions gen assigns until the generation
// or ctx ends, and returns once the session has stopped and committed.
// The session runs in a function the generation waits for, so the member
// rejoins only after it. When ctx ended, that function waits for Run to
// close the group, which ends the generation, so that the member leaves
// rather than joining another generation first (unless a rebalance ended
// the generation meanwhile: then kafka-go rejoins before Run's Close
// leaves).
func (c *Consumer) runGeneration(ctx context.Context, gen *kafka.Generation, rc kafka.ReaderConfig, ctl *controlChecker, rebalanceGrace time.Duration) {
	stopped := make(chan struct{})
	gen.Start(func(gctx context.Context) {
		c.newSession(ctx, gen, rc, ctl).run(ctx, gctx, rebalanceGrace)
		close(stopped)
		if ctx.Err() != nil {
			<-gctx.Done()
		}
	})
	<-stopped
}

// groupConfig is the consumer group's configuration, from the reader's.
func groupConfig(rc kafka.ReaderConfig) kafka.ConsumerGroupConfig {
	return kafka.ConsumerGroupConfig{
		ID:                     rc.GroupID,
		Brokers:                rc.Brokers,
		Dialer:                 rc.Dialer,
		Topics:                 []string{rc.Topic},
		GroupBalancers:         rc.GroupBalancers,
		HeartbeatInterval:      rc.HeartbeatInterval,
		PartitionWatchInterval: rc.PartitionWatchInterval,
		WatchPartitionChanges:  rc.WatchPartitionChanges,
		SessionTimeout:         rc.SessionTimeout,
		RebalanceTimeout:       rc.RebalanceTimeout,
		JoinGroupBackoff:       rc.JoinGroupBackoff,
		RetentionTime:          rc.RetentionTime,
		StartOffset:            rc.StartOffset,
		Logger:                 rc.Logger,
		ErrorLogger:            rc.ErrorLogger,
	}
}

// partitionReader returns a reader of one assigned partition, from the
// group's reader configuration, starting at the assignment's offset (a
// committed one, or FirstOffset or LastOffset by StartOffset). Its queue
// is the group's share for one of n partitions.
func partitionReader(rc kafka.ReaderConfig, a kafka.PartitionAssignment, n int) (*kafka.Reader, error) {
	pc := rc
	pc.GroupID = ""
	pc.Partition = a.ID
	pc.QueueCapacity = max(16, rc.QueueCapacity/max(1, n))
	r := kafka.NewReader(pc)
	if err := r.SetOffset(a.Offset); err != nil {
		_ = r.Close()
		return nil, err
	}
	return r, nil
}

func (c *Consumer) closeWriter() {
	if c.ownWriter {
		c.closeOwned(c.writer)
	}
}

func (c *Consumer) closeOwned(w *kafka.Writer) {
	if err := w.Close(); err != nil {
		c.Log.Warn("justonce kafka: closing the dead-letter writer", "err", err)
	}
	if t, ok := w.Transport.(*kafka.Transport); ok {
		t.CloseIdleConnections()
	}
}

// session is one generation of the group: its partitions' readers, the
// lanes of messages waiting to run (lanes.Scheduler: a lane per partition,
// or per key bucket of a partition with ByKey), and the commit watermark.
// The fetch loops stop fetching only when Config.MaxBuffered messages are
// waiting in the lanes.
type session struct {
	c     *Consumer
	gen   *kafka.Generation
	rc    kafka.ReaderConfig
	ctl   *controlChecker
	tr    *offsets.Tracker[topicPartition]
	lanes *lanes.Scheduler[topicPartition]
}

// topicPartition names one partition.
type topicPartition struct {
	topic     string
	partition int
}

func (c *Consumer) newSession(ctx context.Context, gen *kafka.Generation, rc kafka.ReaderConfig, ctl *controlChecker) *session {
	s := &session{
		c:   c,
		gen: gen,
		rc:  rc,
		ctl: ctl,
		tr:  offsets.NewTracker[topicPartition](),
	}
	// Handlers run on a context that keeps ctx's values but not its
	// cancellation, so that in-flight work finishes at shutdown; the
	// lanes stop when the session stops them.
	s.lanes = lanes.New[topicPartition](context.WithoutCancel(ctx), ctx, lanes.Config{
		Scheduling: c.cfg.Scheduling,
		Buffer:     max(c.cfg.MaxBuffered, c.cfg.BatchSize),
		Proc:       c.Proc,
		Filter:     s.marker,
		Settle:     s.settle,
		Log:        c.Log,
		Name:       "justonce kafka",
	})
	return s
}

func (s *session) run(ctx, gctx context.Context, rebalanceGrace time.Duration) {
	defer s.lanes.Cancel()
	cfg := s.c.cfg
	commitCtx, stopCommits := context.WithCancel(s.lanes.Context())
	committerDone := make(chan struct{})
	go func() {
		defer close(committerDone)
		s.commitLoop(commitCtx)
	}()

	// Fetch until Run's context or the generation ends.
	fetchCtx, stopFetch := context.WithCancel(ctx)
	defer stopFetch()
	defer context.AfterFunc(gctx, stopFetch)()
	assigned := s.gen.Assignments[cfg.Topic]
	var fetchers sync.WaitGroup
	for _, a := range assigned {
		r, err := partitionReader(s.rc, a, len(assigned))
		if err != nil {
			s.c.Log.WarnContext(ctx, "justonce kafka: cannot read an assigned partition in this generation", "topic", cfg.Topic, "partition", a.ID, "err", err)
			continue
		}
		fetchers.Add(1)
		go func() {
			defer fetchers.Done()
			s.fetch(fetchCtx, r)
			if err := r.Close(); err != nil {
				s.c.Log.WarnContext(ctx, "justonce kafka: closing a partition's reader", "topic", cfg.Topic, "partition", a.ID, "err", err)
			}
		}()
	}
	<-fetchCtx.Done()
	// Stop: no new attempts (a message a fetch loop still returning hands
	// over is dropped); wait for the fetch loops, then for the attempts in
	// flight: at shutdown up to ShutdownTimeout, at a rebalance up to
	// rebalanceGrace, so that this member's commit and rejoin fit in the
	// time the coordinator waits for it. A rebalance that ends the
	// generation during a shutdown's wait cuts it to rebalanceGrace, since
	// the member's heartbeats have stopped.
	s.lanes.Stop()
	fetchers.Wait()
	w := lanes.Wait{Grace: cfg.ShutdownTimeout, What: "in-flight handlers", Why: "shutdown", Cut: gctx.Done(), RebalanceGrace: rebalanceGrace}
	if ctx.Err() == nil {
		w = lanes.Wait{Grace: rebalanceGrace, What: "in-flight handlers", Why: "rebalance", Rebalance: true}
	}
	if left := s.lanes.Await(w); left != nil {
		// Handlers that ignore their cancellation, left behind at the
		// rebalance: the commit below stops below their messages, and
		// Run waits for them before it returns.
		s.c.leftover.Add(1)
		go func() {
			<-left
			s.c.leftover.Done()
		}()
	}
	stopCommits()
	<-committerDone
	s.commit(context.WithoutCancel(ctx))
}

// fetch hands the messages r fetches to their lanes until ctx is done.
func (s *session) fetch(ctx context.Context, r *kafka.Reader) {
	failing := false
	for {
		km, err := r.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if !failing {
				s.c.Log.WarnContext(ctx, "justonce kafka: fetch failed, retrying", "topic", s.c.cfg.Topic, "partition", r.Config().Partition, "err", err)
				failing = true
			}
			if consumer.Sleep(ctx, 500*time.Millisecond) != nil {
				return
			}
			continue
		}
		failing = false
		// Room for the message in the buffer shared by the partitions
		// (taken after the fetch: a quiet partition must not hold a place
		// while it waits for a message). A message left here at the stop
		// is not tracked: its offset and the later ones stay uncommitted.
		if !s.lanes.Reserve(ctx) {
			return
		}
		tp := topicPartition{km.Topic, km.Partition}
		s.tr.Fetched(tp, km.Offset)
		s.lanes.Enqueue(tp, fromKafka(km))
	}
}

// marker reports whether m is a transaction marker, which is skipped
// (marked done without running): it
// has the marker's shape and the broker says its batch is a control batch.
// A plain record of the same shape is not a marker: it runs, or without an
// event ID follows the no-ID policy (dead letter, or Processor.AllowNoID).
// ok is false when the consumer stopped before the broker answered.
func (s *session) marker(run, stopping context.Context, m *consumer.Message) (marker, ok bool) {
	km, _ := m.Raw.(kafka.Message)
	if !looksLikeMarker(km) {
		return false, true
	}
	tp := topicPartition{m.Topic, m.Partition}
	failing := false
	for {
		ctl, err := s.ctl.isControl(run, tp, m.Offset)
		if err == nil {
			if ctl {
				s.c.Log.Debug("justonce kafka: skipping a transaction marker", "topic", m.Topic, "partition", m.Partition, "offset", m.Offset)
			}
			return ctl, true
		}
		if !failing {
			s.c.Log.Warn("justonce kafka: cannot tell whether a record is a transaction marker; retrying", "topic", m.Topic, "partition", m.Partition, "offset", m.Offset, "err", err)
			failing = true
		}
		if consumer.Sleep(stopping, 500*time.Millisecond) != nil {
			return false, false
		}
	}
}

// settle marks an acked message done for the commit watermark. A stopped
// one stays pending: its offset is never committed by this member.
func (s *session) settle(m *consumer.Message, d consumer.Decision) {
	if d.Action == consumer.Ack {
		s.tr.Done(topicPartition{m.Topic, m.Partition}, m.Offset)
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
			s.commit(ctx)
		}
	}
}

// commit commits, for each partition, the offset below which everything
// is done, under the session's generation. A failed commit (a broker away,
// or the generation over: the coordinator refuses it) is logged and, while
// the generation lasts, tried again next time: the offsets stay where they
// were, so messages may come again, and the ledger skips them.
func (s *session) commit(ctx context.Context) {
	offs := s.tr.Committable(nil)
	if len(offs) == 0 {
		return
	}
	byTopic := map[string]map[int]int64{}
	for tp, next := range offs {
		if byTopic[tp.topic] == nil {
			byTopic[tp.topic] = map[int]int64{}
		}
		byTopic[tp.topic][tp.partition] = next
	}
	if err := s.gen.CommitOffsets(byTopic); err != nil {
		s.c.Log.WarnContext(ctx, "justonce kafka: offset commit failed; will retry while the generation lasts (redelivered messages are deduplicated)", "group", s.c.cfg.GroupID, "generation", s.gen.ID, "err", err)
		return
	}
	s.tr.Committed(offs)
}
