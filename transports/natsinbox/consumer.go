package natsinbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/internal/front"
)

// Consumer consumes a JetStream durable or a core NATS subject with
// exactly-once effects. Create it with New and start it with Run.
type Consumer struct {
	front.Front
	cfg Config
	js  jetstream.JetStream // nil in core mode
	hb  *heartbeat          // nil when disabled or in core mode
	// stream and its creation time, set by setup (JetStream): they name
	// the messages in the attempt table.
	stream        string
	streamCreated int64
}

// New returns a Consumer that runs h for each new event of the stream's
// durable (JetStream) or of the subject (core NATS). It validates cfg and
// applies the defaults; it does not touch the network: Run creates or
// binds the JetStream consumer.
//
//	c, err := natsinbox.New(natsinbox.Config{
//		Conn:      nc,
//		Stream:    "ORDERS",
//		Durable:   "billing",
//		Processor: consumer.Config{Ledger: ledger},
//	}, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
//		_, err := tx.Exec(ctx, `INSERT INTO invoices (order_id) VALUES ($1)`, m.ID)
//		return err
//	})
func New(cfg Config, h consumer.Handler) (*Consumer, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	c := &Consumer{cfg: cfg}
	if cfg.jetStream() {
		js, err := jetstream.New(cfg.Conn)
		if err != nil {
			return nil, fmt.Errorf("justonce/natsinbox: %w", err)
		}
		c.js = js
	}
	if _, err := c.Init(cfg.Processor, h, func() front.DeadLetter { return c.publishDeadLetter }); err != nil {
		return nil, err
	}
	return c, nil
}

// Config returns the configuration with defaults applied.
func (c *Consumer) Config() Config {
	cfg := c.cfg
	cfg.Processor = c.Proc.Config()
	return cfg
}

// Run consumes until ctx ends, then shuts down as every front does (see
// the consumer package, "Fronts"): it stops pulling, lets the attempts in
// flight finish (up to Config.ShutdownTimeout, then cancels them and waits
// for them to return), acks them, Naks what was pulled but not finished so
// that another member gets it at once, and returns nil. It returns an
// error when the consumer cannot be set up (stream or durable missing, a configuration that would consume its own
// dead letters, a stream that outlives the ledger under
// consumer.HorizonRefuse: see consumer.Config.Horizon) or stops for good
// (the durable was deleted). A second call returns consumer.ErrRunOnce.
func (c *Consumer) Run(ctx context.Context) error {
	if err := c.Started(); err != nil {
		return err
	}
	if c.js != nil {
		return c.runJetStream(ctx)
	}
	return c.runCore(ctx)
}

// procContext returns the context handlers run with: it outlives ctx by
// up to ShutdownTimeout, so in-flight work finishes during a drain. Call
// the returned start when ctx ends to begin the countdown.
func (c *Consumer) procContext(ctx context.Context) (pctx context.Context, startDrain func(), cancel context.CancelFunc) {
	pctx, cancel = context.WithCancel(context.WithoutCancel(ctx))
	var once sync.Once
	startDrain = func() {
		once.Do(func() {
			t := time.AfterFunc(c.cfg.ShutdownTimeout, func() {
				c.Log.WarnContext(ctx, "justonce natsinbox: in-flight handlers still running after the shutdown timeout; cancelling them", "timeout", c.cfg.ShutdownTimeout)
				cancel()
			})
			context.AfterFunc(pctx, func() { t.Stop() })
		})
	}
	return pctx, startDrain, cancel
}

// headers converts NATS headers to the runtime's, sorted by name (NATS
// keeps no order between names) and in order within a name.
func headers(h nats.Header) []consumer.Header {
	if len(h) == 0 {
		return nil
	}
	keys := make([]string, 0, len(h))
	n := 0
	for k, vs := range h {
		keys = append(keys, k)
		n += len(vs)
	}
	sort.Strings(keys)
	out := make([]consumer.Header, 0, n)
	for _, k := range keys {
		for _, v := range h[k] {
			out = append(out, consumer.Header{Key: k, Value: []byte(v)})
		}
	}
	return out
}

// jsMessage converts a JetStream message: Offset is the stream sequence,
// Time the stream timestamp, and Attempt and Uncounted what this process
// counted for the message before it was last handed back to JetStream
// (1 and 0 for a message it has not failed on). JetStream's delivery count
// is not the attempt: drains, restarts and expired AckWaits raise it too.
func (c *Consumer) jsMessage(m jetstream.Msg) *consumer.Message {
	msg := &consumer.Message{
		Topic:   m.Subject(),
		Headers: headers(m.Headers()),
		Value:   m.Data(),
		Attempt: 1,
		Raw:     m,
	}
	if md, err := m.Metadata(); err == nil {
		msg.Offset = int64(md.Sequence.Stream)
		msg.Time = md.Timestamp
		if n, ok := attempts.get(c.attemptKey(msg)); ok {
			msg.Attempt, msg.Uncounted = max(n.attempt, 1), n.uncounted
		}
	} else {
		c.Log.Warn("justonce natsinbox: message without JetStream metadata", "subject", m.Subject(), "err", err)
	}
	return msg
}

// attemptKey names msg in the attempt table.
func (c *Consumer) attemptKey(msg *consumer.Message) attemptKey {
	return attemptKey{stream: c.stream, created: c.streamCreated, durable: c.cfg.Durable,
		scope: c.cfg.Processor.Scope, seq: uint64(msg.Offset)}
}

// remember keeps or drops msg's counts as d settles it: a message done
// (acked or dead-lettered) is forgotten; one handed back to JetStream keeps
// its counts for its redelivery.
func (c *Consumer) remember(msg *consumer.Message, d consumer.Decision) {
	if msg.Offset <= 0 {
		return
	}
	k := c.attemptKey(msg)
	switch d.Action {
	case consumer.Ack:
		attempts.forget(k)
	default:
		n := attemptCount{attempt: msg.Attempt, uncounted: msg.Uncounted}
		if d.Action == consumer.Retry && d.Counted {
			n.attempt++ // the failure this Decision reports
		}
		attempts.put(k, n)
	}
}

// settle acks, naks or terms m as the Decision says.
func (c *Consumer) settle(m jetstream.Msg, msg *consumer.Message, d consumer.Decision) {
	c.remember(msg, d)
	var err error
	switch d.Action {
	case consumer.Ack:
		if c.cfg.beforeAck != nil {
			c.cfg.beforeAck(msg)
		}
		switch {
		case d.DeadLettered:
			err = m.TermWithReason(termReason(msg, d.Err))
		case c.cfg.DoubleAck:
			ctx, cancel := context.WithTimeout(context.Background(), c.cfg.AckTimeout)
			err = m.DoubleAck(ctx)
			cancel()
		default:
			err = m.Ack()
		}
	case consumer.Retry:
		err = m.NakWithDelay(d.Delay)
	default: // Stop: ask for an immediate redelivery; the ledger dedupes.
		err = m.Nak()
	}
	if err != nil && !errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
		// The message comes again after AckWait; the ledger answers
		// Duplicate if its transaction committed.
		c.Log.Warn("justonce natsinbox: ack failed, the message will be redelivered", "action", d.Action.String(),
			"id", inbox.Mask(msg.ID), "subject", msg.Topic, "seq", msg.Offset, "err", err)
	}
}

// termReason is the reason given to TermWithReason: one short line.
func termReason(msg *consumer.Message, cause error) string {
	s := "justonce: dead-lettered"
	if cause != nil {
		s += ": " + cause.Error()
	}
	s = strings.Map(func(r rune) rune {
		if r == '\r' || r == '\n' {
			return ' '
		}
		return r
	}, s)
	if len(s) > 200 {
		s = s[:200]
	}
	return s
}

// heartbeat marks the messages whose handlers run as InProgress at a fixed
// interval, so JetStream does not redeliver them while they run.
type heartbeat struct {
	mu   sync.Mutex
	msgs map[jetstream.Msg]struct{}
}

func (h *heartbeat) add(ms ...jetstream.Msg) {
	if h == nil {
		return
	}
	h.mu.Lock()
	for _, m := range ms {
		h.msgs[m] = struct{}{}
	}
	h.mu.Unlock()
}

func (h *heartbeat) remove(ms ...jetstream.Msg) {
	if h == nil {
		return
	}
	h.mu.Lock()
	for _, m := range ms {
		delete(h.msgs, m)
	}
	h.mu.Unlock()
}

// run ticks until stop is closed.
func (h *heartbeat) run(stop <-chan struct{}, every time.Duration, log *slog.Logger) {
	t := time.NewTicker(max(every, 10*time.Millisecond))
	defer t.Stop()
	var batch []jetstream.Msg
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		batch = batch[:0]
		h.mu.Lock()
		for m := range h.msgs {
			batch = append(batch, m)
		}
		h.mu.Unlock()
		for _, m := range batch {
			if err := m.InProgress(); err != nil && !errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
				log.Warn("justonce natsinbox: InProgress failed", "subject", m.Subject(), "err", err)
			}
		}
	}
}
