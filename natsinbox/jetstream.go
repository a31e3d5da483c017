package natsinbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// setup creates, updates or binds the durable and checks the stream, and
// returns the consumer with its ack wait.
func (c *Consumer) setup(ctx context.Context) (jetstream.Consumer, time.Duration, error) {
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	stream, err := c.js.Stream(sctx, c.cfg.Stream)
	if err != nil {
		return nil, 0, fmt.Errorf("justonce/natsinbox: stream %q: %w", c.cfg.Stream, err)
	}
	si := stream.CachedInfo()
	c.stream, c.streamCreated = si.Config.Name, si.Created.UnixNano()

	var cons jetstream.Consumer
	if c.cfg.Bind {
		cons, err = stream.Consumer(sctx, c.cfg.Durable)
		if err != nil {
			return nil, 0, fmt.Errorf("justonce/natsinbox: bind durable %q: %w", c.cfg.Durable, err)
		}
		cc := cons.CachedInfo().Config
		if cc.AckPolicy != jetstream.AckExplicitPolicy {
			return nil, 0, fmt.Errorf("%w: natsinbox: durable %q must use explicit acks, has %s", inbox.ErrConfig, c.cfg.Durable, cc.AckPolicy)
		}
		if max := c.proc.Config().MaxAttempts; cc.MaxDeliver > 0 && cc.MaxDeliver < max {
			return nil, 0, fmt.Errorf("%w: natsinbox: durable %q has MaxDeliver %d below Processor.MaxAttempts %d: JetStream would stop delivering a failing message before it is dead-lettered",
				inbox.ErrConfig, c.cfg.Durable, cc.MaxDeliver, max)
		}
	} else {
		cc := jetstream.ConsumerConfig{
			Durable:       c.cfg.Durable,
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       c.cfg.AckWait,
			MaxAckPending: c.cfg.MaxAckPending,
			// Unlimited: the runtime counts handler failures and
			// dead-letters after MaxAttempts; a server limit on deliveries
			// would silently stop redelivering a message that was never
			// dead-lettered.
			MaxDeliver: -1,
		}
		if len(c.cfg.FilterSubjects) == 1 {
			cc.FilterSubject = c.cfg.FilterSubjects[0]
		} else {
			cc.FilterSubjects = c.cfg.FilterSubjects
		}
		cons, err = stream.CreateOrUpdateConsumer(sctx, cc)
		if err != nil {
			return nil, 0, fmt.Errorf("justonce/natsinbox: durable %q on stream %q: %w", c.cfg.Durable, c.cfg.Stream, err)
		}
	}
	info := cons.CachedInfo()

	subjects := info.Config.FilterSubjects
	if f := info.Config.FilterSubject; f != "" {
		subjects = []string{f}
	}
	if len(subjects) == 0 {
		subjects = si.Config.Subjects
	}
	if err := c.cfg.checkDeadLetterLoop(subjects); err != nil {
		return nil, 0, err
	}
	ttl := c.proc.Config().TTL
	if ttl == 0 {
		ttl = c.proc.Config().Ledger.DefaultTTL()
	}
	if si.Config.MaxAge > ttl {
		c.log.Warn("justonce natsinbox: the stream keeps messages longer than the ledger keeps their IDs; a redelivery or replay after the ledger row expired runs the handler again",
			"stream", c.cfg.Stream, "max_age", si.Config.MaxAge, "ledger_ttl", ttl)
	}
	ackWait := info.Config.AckWait
	if ackWait <= 0 {
		ackWait = DefaultAckWait
	}
	return cons, ackWait, nil
}

func (c *Consumer) runJetStream(ctx context.Context) error {
	cons, ackWait, err := c.setup(ctx)
	if err != nil {
		return err
	}
	hbStop := make(chan struct{})
	defer close(hbStop)
	if every := c.cfg.Heartbeat; every >= 0 {
		if every == 0 {
			every = ackWait / 3
		}
		c.hb = &heartbeat{msgs: map[jetstream.Msg]struct{}{}}
		go c.hb.run(hbStop, every, c.log)
	}
	pctx, startDrain, cancel := c.procContext(ctx)
	defer cancel()
	if c.cfg.BatchSize > 0 {
		err = c.runFetch(ctx, pctx, startDrain, cons)
	} else {
		err = c.runConsume(ctx, pctx, startDrain, cons)
	}
	return err
}

// handle processes one message and settles it. pctx is the handlers'
// context; stopping ends when the consumer stops.
func (c *Consumer) handle(pctx, stopping context.Context, m jetstream.Msg) {
	msg := c.jsMessage(m)
	c.hb.add(m)
	d := consumer.Decision{Action: consumer.Stop, Err: context.Cause(stopping)}
	if stopping.Err() == nil {
		d = c.proc.ProcessWithRetry(pctx, msg, waitUntil(stopping))
	}
	c.hb.remove(m)
	c.settle(m, msg, d)
}

// waitUntil is the wait between attempts given to the runtime's retry loop
// (consumer.Processor.Retry): every retry, counted (the handler failed) or
// not (the database was unavailable, another consumer held the event),
// happens in place, with the message kept InProgress by the heartbeat,
// rather than through a Nak and a redelivery. The attempt count stays with
// the message in this process, and a poison message occupies one worker
// for its retry budget without being handed to another member with its
// count lost. When stopping ends, the wait ends at once (an attempt in
// progress runs to its decision on the handlers' context first); the Stop
// decision that follows Naks the message, and its counts are kept for its
// redelivery (see remember).
func waitUntil(stopping context.Context) func(context.Context, time.Duration) error {
	return func(_ context.Context, d time.Duration) error { return consumer.Sleep(stopping, d) }
}

// runConsume pulls with Consume and hands each message to a worker.
func (c *Consumer) runConsume(ctx, pctx context.Context, startDrain func(), cons jetstream.Consumer) error {
	jobs := make(chan jetstream.Msg)
	draining := make(chan struct{})
	stopping, stopAll := context.WithCancel(context.Background())
	defer stopAll()
	var wg sync.WaitGroup
	for range c.cfg.Concurrency {
		wg.Go(func() {
			for m := range jobs {
				c.handle(pctx, stopping, m)
			}
		})
	}
	var (
		mu       sync.Mutex
		terminal error
	)
	cc, err := cons.Consume(func(m jetstream.Msg) {
		select {
		case <-draining:
			_ = m.Nak() // pulled but not started: to another member now
			return
		default:
		}
		select {
		case jobs <- m:
		case <-draining:
			_ = m.Nak()
		}
	},
		jetstream.PullMaxMessages(c.cfg.MaxBuffered),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrBadRequest) ||
				errors.Is(err, jetstream.ErrConnectionClosed) {
				mu.Lock()
				terminal = err
				mu.Unlock()
			}
			c.log.Warn("justonce natsinbox: consume", "durable", c.cfg.Durable, "err", err)
		}),
	)
	if err != nil {
		close(jobs)
		wg.Wait()
		return fmt.Errorf("justonce/natsinbox: consume %q: %w", c.cfg.Durable, err)
	}
	if c.cfg.ready != nil {
		c.cfg.ready()
	}

	var stopped bool
	select {
	case <-ctx.Done():
	case <-cc.Closed():
		stopped = true
	}
	startDrain()
	close(draining)
	stopAll()
	cc.Drain()
	<-cc.Closed()
	close(jobs)
	wg.Wait()
	if stopped && ctx.Err() == nil {
		mu.Lock()
		defer mu.Unlock()
		if terminal == nil {
			terminal = errors.New("consumer stopped")
		}
		return fmt.Errorf("justonce/natsinbox: durable %q: %w", c.cfg.Durable, terminal)
	}
	return nil
}

// runFetch runs Concurrency fetch loops in batch mode.
func (c *Consumer) runFetch(ctx, pctx context.Context, startDrain func(), cons jetstream.Consumer) error {
	context.AfterFunc(ctx, startDrain)
	if c.cfg.ready != nil {
		c.cfg.ready()
	}
	errs := make([]error, c.cfg.Concurrency)
	var wg sync.WaitGroup
	// A loop that fails for good stops the others.
	lctx, stop := context.WithCancel(ctx)
	defer stop()
	for i := range c.cfg.Concurrency {
		wg.Go(func() {
			if errs[i] = c.fetchLoop(lctx, pctx, cons); errs[i] != nil {
				stop()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// fetchLoop fetches and handles batches until ctx ends.
func (c *Consumer) fetchLoop(ctx, pctx context.Context, cons jetstream.Consumer) error {
	backoff := consumer.Backoff{Initial: 100 * time.Millisecond, Max: 5 * time.Second}
	failures := 0
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	for ctx.Err() == nil {
		b, err := cons.Fetch(c.cfg.BatchSize, jetstream.FetchMaxWait(c.cfg.FetchWait))
		if err == nil {
			// Messages delivered to this request are handled (or, once ctx
			// ended, Nak'ed) until the request is done: none is abandoned
			// to wait for AckWait.
			ch := b.Messages()
			for {
				ms := gather(ch, c.cfg.BatchSize, linger)
				if len(ms) == 0 {
					break
				}
				if ctx.Err() != nil {
					for _, m := range ms {
						_ = m.Nak()
					}
					continue
				}
				c.handleBatch(pctx, ctx, ms) // ctx: the loop's, ended on shutdown or a failed sibling
			}
			err = b.Error()
		}
		if err == nil || errors.Is(err, nats.ErrTimeout) {
			failures = 0
			continue
		}
		if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) ||
			errors.Is(err, jetstream.ErrBadRequest) || errors.Is(err, nats.ErrConnectionClosed) {
			return fmt.Errorf("justonce/natsinbox: fetch from durable %q: %w", c.cfg.Durable, err)
		}
		failures++
		c.log.Warn("justonce natsinbox: fetch", "durable", c.cfg.Durable, "err", err)
		_ = consumer.Sleep(ctx, backoff.Delay(failures))
	}
	return nil
}

// batchLinger is how long gather waits for the next message of a burst.
const batchLinger = 2 * time.Millisecond

// gather returns the messages at hand, up to n: it waits for the first (nil
// when ch is closed), then takes what arrives while the burst lasts.
func gather(ch <-chan jetstream.Msg, n int, linger *time.Timer) []jetstream.Msg {
	first, ok := <-ch
	if !ok {
		return nil
	}
	ms := []jetstream.Msg{first}
	for len(ms) < n {
		select {
		case m, ok := <-ch:
			if !ok {
				return ms
			}
			ms = append(ms, m)
			continue
		default:
		}
		linger.Reset(batchLinger)
		select {
		case m, ok := <-ch:
			linger.Stop()
			if !ok {
				return ms
			}
			ms = append(ms, m)
		case <-linger.C:
			return ms
		}
	}
	return ms
}

// handleBatch handles ms in one ledger transaction and settles each: what
// is decided at once first, then, one by one and in place, what failed or
// waits on the database or on another consumer. stopping ends when the
// consumer stops.
func (c *Consumer) handleBatch(pctx, stopping context.Context, ms []jetstream.Msg) {
	msgs := make([]*consumer.Message, len(ms))
	for i, m := range ms {
		msgs[i] = c.jsMessage(m)
	}
	c.hb.add(ms...)
	ds := c.proc.ProcessBatch(pctx, msgs)
	for i, m := range ms {
		if ds[i].Action != consumer.Retry {
			c.hb.remove(m)
			c.settle(m, msgs[i], ds[i])
		}
	}
	for i, m := range ms {
		if ds[i].Action == consumer.Retry {
			d := c.proc.Retry(pctx, msgs[i], ds[i], waitUntil(stopping))
			c.hb.remove(m)
			c.settle(m, msgs[i], d)
		}
	}
}
