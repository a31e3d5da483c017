package kafkainbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/justonce/justonce/consumer"
)

// ErrRunOnce: Run was called on a Consumer that has already run. Create a
// new Consumer to consume again.
var ErrRunOnce = errors.New("justonce/kafkainbox: Run may be called once")

// Consumer is one member of a Kafka consumer group whose handler runs once
// per event ID. Create it with New and start it with Run.
type Consumer struct {
	cfg       Config
	h         consumer.Handler
	userDL    bool // Processor.DeadLetter was given
	proc      *consumer.Processor
	log       *slog.Logger
	writer    *kafka.Writer // dead letters; nil when Processor.DeadLetter was given
	ownWriter bool
	ran       atomic.Bool
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
	cfg = cfg.withDefaults()
	c := &Consumer{cfg: cfg, h: h, userDL: cfg.Processor.DeadLetter != nil}
	if !c.userDL {
		c.writer, c.ownWriter = c.deadLetterWriter()
		cfg.Processor.DeadLetter = c.deadLetterTo(c.writer)
	}
	p, err := consumer.New(cfg.Processor, h)
	if err != nil {
		return nil, err
	}
	c.proc = p
	c.cfg.Processor = p.Config()
	c.log = c.cfg.Processor.Logger
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
func (c *Consumer) deadLetterTo(w *kafka.Writer) consumer.DeadLetterFunc {
	return func(ctx context.Context, m *consumer.Message, cause error) error {
		return w.WriteMessages(ctx, kafka.Message{
			Topic:   c.cfg.DeadLetterTopic,
			Key:     m.Key,
			Value:   m.Value,
			Headers: toKafkaHeaders(consumer.DeadLetterHeaders(c.cfg.Processor.Scope, m, cause)),
		})
	}
}

func (c *Consumer) readerConfig() kafka.ReaderConfig {
	rc := kafka.ReaderConfig{
		MaxWait:           time.Second,
		HeartbeatInterval: time.Second,
		QueueCapacity:     max(100, 2*c.cfg.BatchSize),
		ErrorLogger: kafka.LoggerFunc(func(format string, args ...any) {
			if c.log.Enabled(context.Background(), slog.LevelWarn) {
				c.log.Warn("justonce kafka: kafka-go: " + fmt.Sprintf(format, args...))
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

// Run consumes until ctx is done, then shuts down gracefully: it stops
// fetching, lets the messages being processed finish (handlers keep an
// uncancelled context for up to Config.ShutdownTimeout; queued messages not
// yet started are left for redelivery), commits the offsets of what is done,
// and leaves the group. It returns nil after a graceful shutdown. Errors from
// Kafka or Postgres while running are retried and logged, never returned:
// messages wait, they are not skipped.
//
// Run may be called once per Consumer.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.ran.CompareAndSwap(false, true) {
		return ErrRunOnce
	}
	defer c.closeWriter()
	rc := c.readerConfig()
	if err := rc.Validate(); err != nil {
		return fmt.Errorf("justonce/kafkainbox: reader config: %w", err)
	}
	s := c.newSession(ctx, kafka.NewReader(rc))
	s.run(ctx)
	return nil
}

func (c *Consumer) closeWriter() {
	if c.ownWriter {
		c.closeOwned(c.writer)
	}
}

func (c *Consumer) closeOwned(w *kafka.Writer) {
	if err := w.Close(); err != nil {
		c.log.Warn("justonce kafka: closing the dead-letter writer", "err", err)
	}
	if t, ok := w.Transport.(*kafka.Transport); ok {
		t.CloseIdleConnections()
	}
}

// session is one Run: the reader, the workers and the commit watermark.
type session struct {
	c        *Consumer
	reader   *kafka.Reader
	tr       *tracker
	queues   []chan *consumer.Message
	stopping chan struct{} // closed when Run's context ends: no new attempts
	procCtx  context.Context
	cancel   context.CancelFunc // cancels procCtx
}

func (c *Consumer) newSession(ctx context.Context, r *kafka.Reader) *session {
	// Handlers run on a context that keeps ctx's values but not its
	// cancellation, so that in-flight work finishes at shutdown.
	procCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s := &session{
		c:        c,
		reader:   r,
		tr:       newTracker(),
		queues:   make([]chan *consumer.Message, c.cfg.Concurrency),
		stopping: make(chan struct{}),
		procCtx:  procCtx,
		cancel:   cancel,
	}
	for i := range s.queues {
		s.queues[i] = make(chan *consumer.Message, max(2*c.cfg.BatchSize, 16))
	}
	return s
}

func (s *session) run(ctx context.Context) {
	defer s.cancel()
	cfg := s.c.cfg
	var workers sync.WaitGroup
	for _, q := range s.queues {
		workers.Add(1)
		go func() {
			defer workers.Done()
			s.work(q)
		}()
	}
	commitCtx, stopCommits := context.WithCancel(s.procCtx)
	committerDone := make(chan struct{})
	go func() {
		defer close(committerDone)
		s.commitLoop(commitCtx)
	}()

	s.fetch(ctx)

	// Shutdown: no new attempts; wait for in-flight ones.
	close(s.stopping)
	workersDone := make(chan struct{})
	go func() {
		workers.Wait()
		close(workersDone)
	}()
	grace := time.NewTimer(cfg.ShutdownTimeout)
	select {
	case <-workersDone:
		grace.Stop()
	case <-grace.C:
		s.c.log.Warn("justonce kafka: in-flight handlers still running after the shutdown timeout; cancelling them", "timeout", cfg.ShutdownTimeout)
		s.cancel()
		<-workersDone
	}
	stopCommits()
	<-committerDone

	final, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
	s.commit(final)
	cancel()
	if err := s.reader.Close(); err != nil {
		s.c.log.Warn("justonce kafka: closing the reader", "err", err)
	}
}

// fetch hands fetched messages to the workers until ctx is done.
func (s *session) fetch(ctx context.Context) {
	failing := false
	for {
		km, err := s.reader.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if !failing {
				s.c.log.Warn("justonce kafka: fetch failed, retrying", "topic", s.c.cfg.Topic, "err", err)
				failing = true
			}
			if !sleepCtx(ctx, 500*time.Millisecond) {
				return
			}
			continue
		}
		failing = false
		tp := topicPartition{km.Topic, km.Partition}
		s.tr.fetched(tp, km.Offset)
		if s.marker(km) {
			s.tr.done(tp, km.Offset) // nothing to run; the commit may pass it
			continue
		}
		select {
		case s.queues[s.route(km)] <- fromKafka(km):
		case <-ctx.Done():
			// Left pending: the commit stays below it and it comes again.
			return
		}
	}
}

// marker reports whether km is a transaction marker, not an event: it has
// the marker's shape and no event ID.
func (s *session) marker(km kafka.Message) bool {
	if !isControlRecord(km) {
		return false
	}
	if id, err := s.c.cfg.Processor.ID(fromKafka(km)); err == nil && id != "" {
		return false
	}
	s.c.log.Debug("justonce kafka: skipping a transaction marker", "topic", km.Topic, "partition", km.Partition, "offset", km.Offset)
	return true
}

// route picks the worker of a message: by partition, or by partition and
// key, so that what must stay ordered stays on one worker.
func (s *session) route(km kafka.Message) int {
	n := uint32(len(s.queues))
	if n == 1 {
		return 0
	}
	h := uint32(2166136261) // FNV-1a
	mix := func(b byte) { h ^= uint32(b); h *= 16777619 }
	for i := 0; i < len(km.Topic); i++ {
		mix(km.Topic[i])
	}
	if s.c.cfg.Ordering == ByKey && len(km.Key) > 0 {
		for p, i := uint32(km.Partition), 0; i < 4; i, p = i+1, p>>8 {
			mix(byte(p))
		}
		for _, b := range km.Key {
			mix(b)
		}
		return int(h % n)
	}
	return int((h + uint32(km.Partition)) % n)
}

func (s *session) stopped() bool {
	select {
	case <-s.stopping:
		return true
	default:
		return false
	}
}

// work processes one queue's messages in order until shutdown. Messages
// still queued at shutdown are left pending.
func (s *session) work(q chan *consumer.Message) {
	for !s.stopped() {
		var m *consumer.Message
		select {
		case <-s.stopping:
			return
		case m = <-q:
		}
		if s.c.cfg.BatchSize > 0 {
			s.handleBatch(s.gather(q, m))
		} else {
			s.handle(m)
		}
	}
}

// gather collects up to BatchSize messages, waiting at most BatchLinger
// for more once it has the first.
func (s *session) gather(q chan *consumer.Message, first *consumer.Message) []*consumer.Message {
	batch := []*consumer.Message{first}
	size := s.c.cfg.BatchSize
	if size <= 1 {
		return batch
	}
	// Take what is already queued without waiting.
	for len(batch) < size {
		select {
		case m := <-q:
			batch = append(batch, m)
			continue
		default:
		}
		break
	}
	if len(batch) == size {
		return batch
	}
	linger := time.NewTimer(s.c.cfg.BatchLinger)
	defer linger.Stop()
	for len(batch) < size {
		select {
		case m := <-q:
			batch = append(batch, m)
		case <-linger.C:
			return batch
		case <-s.stopping:
			return batch
		}
	}
	return batch
}

// handle runs one message to its end: done, dead-lettered, or stopped.
func (s *session) handle(m *consumer.Message) {
	d := s.c.proc.Process(s.procCtx, m)
	s.settle(m, s.retryInPlace(m, d, time.Now()))
}

// handleBatch runs a batch in one transaction, then retries in place,
// in order, the messages that need it; their offsets (and every later one
// of their partition) stay uncommitted until they are done.
func (s *session) handleBatch(batch []*consumer.Message) {
	ds := s.c.proc.ProcessBatch(s.procCtx, batch)
	decided := time.Now()
	for i, m := range batch {
		s.settle(m, s.retryInPlace(m, ds[i], decided))
	}
}

// retryInPlace repeats the attempts of a message that must be retried,
// waiting each decision's delay (counted from when it was decided), until
// it is acked or the consumer is shutting down. Like
// consumer.Processor.ProcessWithRetry, but a shutdown stops the waiting
// without cancelling the attempt in progress.
func (s *session) retryInPlace(m *consumer.Message, d consumer.Decision, decided time.Time) consumer.Decision {
	for d.Action == consumer.Retry {
		if d.Counted {
			m.Attempt++
		}
		if !s.sleep(d.Delay - time.Since(decided)) {
			return consumer.Decision{Action: consumer.Stop, Err: d.Err}
		}
		d = s.c.proc.Process(s.procCtx, m)
		decided = time.Now()
	}
	return d
}

// settle marks an acked message done for the commit watermark. A stopped
// one stays pending: its offset is never committed by this member.
func (s *session) settle(m *consumer.Message, d consumer.Decision) {
	if d.Action == consumer.Ack {
		s.tr.done(topicPartition{m.Topic, m.Partition}, m.Offset)
	}
}

// sleep waits d; false when the consumer is shutting down.
func (s *session) sleep(d time.Duration) bool {
	if d <= 0 {
		return !s.stopped()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-s.stopping:
		return false
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
// is done. A failed commit (a partition revoked by a rebalance, a broker
// away) is logged and tried again next time: the offsets stay where they
// were, so messages may come again, and the ledger skips them.
func (s *session) commit(ctx context.Context) {
	offs := s.tr.committable()
	if len(offs) == 0 {
		return
	}
	msgs := make([]kafka.Message, 0, len(offs))
	for tp, next := range offs {
		// kafka-go commits a message's offset + 1.
		msgs = append(msgs, kafka.Message{Topic: tp.topic, Partition: tp.partition, Offset: next - 1})
	}
	if err := s.reader.CommitMessages(ctx, msgs...); err != nil {
		if errors.Is(ctx.Err(), context.Canceled) && errors.Is(err, context.Canceled) {
			return // interrupted by shutdown; the final commit follows
		}
		s.c.log.Warn("justonce kafka: offset commit failed; will retry (redelivered messages are deduplicated)", "group", s.c.cfg.GroupID, "err", err)
		return
	}
	s.tr.committed(offs)
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
