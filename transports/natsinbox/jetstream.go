package natsinbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/internal/lanes"
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
		if max := c.Proc.Config().MaxAttempts; cc.MaxDeliver > 0 && cc.MaxDeliver < max {
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
	if err := c.checkHorizon(ctx, si, info, subjects); err != nil {
		return nil, 0, err
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
		go c.hb.run(hbStop, every, c.Log)
	}
	return c.runConsume(ctx, cons)
}

// runConsume pulls with Consume and hands the messages to the workers:
// one lane (lanes.Scheduler) that Concurrency goroutines drain. With
// batching (BatchSize > 1) a worker takes, with each message, the ones
// already waiting behind it, up to BatchSize, and runs them as one batch;
// a message that finds none waiting runs at once on its own. What a
// worker has taken is kept InProgress by the heartbeat; each decision is
// settled (acked, Nak'ed, Term'ed) as it is made. Messages pulled but not
// started when the consumer stops are Nak'ed, so that another member gets
// them at once.
//
// Every retry, counted (the handler failed) or not (the database was
// unavailable, another consumer held the event), happens in place (the
// scheduler's wait, given to consumer.Processor.Retry), with the message
// kept InProgress by the heartbeat, rather than through a Nak and a
// redelivery. The attempt count stays with the message in this process,
// and a poison message occupies one worker for its retry budget without
// being handed to another member with its count lost. When the consumer
// stops, the wait ends at once (an attempt in progress runs to its
// decision on the handlers' context first); the Stop decision that follows
// Naks the message, and its counts are kept for its redelivery (see
// remember).
func (c *Consumer) runConsume(ctx context.Context, cons jetstream.Consumer) error {
	size := max(1, c.cfg.BatchSize)
	// The lane stops as soon as ctx ends (synchronously, so that a batch
	// in progress starts no further message once the caller has stopped).
	sched := lanes.New[struct{}](ctx, ctx, lanes.Config{
		Scheduling: c.cfg.Scheduling,
		Buffer:     size - 1, // a batch's worth waiting beside the one a worker takes
		Width:      c.cfg.Concurrency,
		Proc:       c.Proc,
		Start: func(ms []*consumer.Message) {
			for _, msg := range ms {
				c.hb.add(msg.Raw.(jetstream.Msg))
			}
		},
		Settle: c.settleMsg,
		Drop: func(msg *consumer.Message, cause error) {
			c.settleMsg(msg, consumer.Decision{Action: consumer.Stop, Err: cause})
		},
		Log:  c.Log,
		Name: "justonce natsinbox",
	})
	defer sched.Cancel()
	var (
		mu       sync.Mutex
		terminal error
	)
	cc, err := cons.Consume(func(m jetstream.Msg) {
		if !sched.Reserve(ctx) {
			_ = m.Nak() // pulled but not started: to another member now
			return
		}
		sched.Enqueue(struct{}{}, c.jsMessage(m))
	},
		jetstream.PullMaxMessages(c.cfg.MaxBuffered),
		jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
			if errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrBadRequest) ||
				errors.Is(err, jetstream.ErrConnectionClosed) {
				mu.Lock()
				terminal = err
				mu.Unlock()
			}
			c.Log.WarnContext(ctx, "justonce natsinbox: consume", "durable", c.cfg.Durable, "err", err)
		}),
	)
	if err != nil {
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
	stopAt := time.Now()
	sched.Stop()
	cc.Drain()
	<-cc.Closed()
	sched.Await(lanes.Wait{
		Grace: max(c.cfg.ShutdownTimeout-time.Since(stopAt), time.Nanosecond),
		What:  "in-flight handlers", Why: "shutdown",
	})
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

// settleMsg settles a JetStream message's decision: it leaves the
// heartbeat, and is acked, Nak'ed or Term'ed.
func (c *Consumer) settleMsg(msg *consumer.Message, d consumer.Decision) {
	m := msg.Raw.(jetstream.Msg)
	c.hb.remove(m)
	c.settle(m, msg, d)
}
