package natsinbox

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
)

// coreMessage converts a core NATS message. Core NATS has no broker
// timestamp or sequence: Time is the arrival time, Offset 0.
func coreMessage(m *nats.Msg) *consumer.Message {
	return &consumer.Message{
		Topic:   m.Subject,
		Headers: headers(m.Header),
		Value:   m.Data,
		Time:    time.Now(),
		Attempt: 1,
		Raw:     m,
	}
}

// runCore subscribes (in the queue group, if any) and handles each message
// with retries in place, since core NATS does not redeliver.
func (c *Consumer) runCore(ctx context.Context) error {
	if err := c.cfg.checkDeadLetterLoop([]string{c.cfg.Subject}); err != nil {
		return err
	}
	pctx, startDrain, cancel := c.procContext(ctx)
	defer cancel()

	jobs := make(chan *nats.Msg)
	quit := make(chan struct{})
	lost := func(msg *consumer.Message, err error) {
		c.Log.ErrorContext(ctx, "justonce natsinbox: core NATS message not processed before shutdown, lost (core NATS does not redeliver)",
			"id", inbox.Mask(msg.ID), "subject", msg.Topic, "err", err)
	}
	var wg sync.WaitGroup
	for range c.cfg.Concurrency {
		wg.Go(func() {
			for {
				select {
				case <-quit:
					return
				case m := <-jobs:
					msg := coreMessage(m)
					// Retries wait on pctx: core NATS does not redeliver,
					// so they go on during a shutdown, up to
					// ShutdownTimeout.
					if d := c.Proc.ProcessWithRetry(pctx, msg, nil); d.Action != consumer.Ack {
						lost(msg, d.Err)
					}
				}
			}
		})
	}
	handler := func(m *nats.Msg) {
		select {
		case jobs <- m:
		case <-quit:
			lost(coreMessage(m), context.Cause(pctx))
		}
	}
	var (
		sub *nats.Subscription
		err error
	)
	if c.cfg.Queue != "" {
		sub, err = c.cfg.Conn.QueueSubscribe(c.cfg.Subject, c.cfg.Queue, handler)
	} else {
		sub, err = c.cfg.Conn.Subscribe(c.cfg.Subject, handler)
	}
	if err != nil {
		close(quit)
		wg.Wait()
		return fmt.Errorf("justonce/natsinbox: subscribe %q: %w", c.cfg.Subject, err)
	}
	closed := make(chan struct{})
	var once sync.Once
	sub.SetClosedHandler(func(string) { once.Do(func() { close(closed) }) })
	// Make sure the server has the subscription before Run is considered
	// started by anyone publishing right after.
	_ = c.cfg.Conn.FlushTimeout(c.cfg.AckTimeout)
	if c.cfg.ready != nil {
		c.cfg.ready()
	}

	<-ctx.Done()
	startDrain()
	// Drain: the server stops sending; the messages already received are
	// handled (they would be lost otherwise).
	if err := sub.Drain(); err == nil {
		select {
		case <-closed:
		case <-pctx.Done():
			_ = sub.Unsubscribe()
		}
	}
	close(quit)
	wg.Wait()
	return nil
}
