package natsinbox

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/justonce/justonce/consumer"
)

// maxDLHeaderValue caps a dead-letter header value (the error text):
// NATS headers travel in the message, under the server's max payload.
const maxDLHeaderValue = 4096

// deadLetterSubject returns where a message from subject goes when it
// fails for good.
func (c *Consumer) deadLetterSubject(subject string) string {
	if c.cfg.DeadLetterSubject != "" {
		return c.cfg.DeadLetterSubject
	}
	return subject + DeadLetterSuffix
}

// publishDeadLetter is the default Processor.DeadLetter: it publishes m
// with the consumer.DeadLetterHeadersContext, confirmed by JetStream (JetStream
// mode) or flushed to the server (core mode). An error makes the runtime
// retry the message instead of acking it.
func (c *Consumer) publishDeadLetter(ctx context.Context, m *consumer.Message, cause error) error {
	out := nats.NewMsg(c.deadLetterSubject(m.Topic))
	for _, h := range consumer.DeadLetterHeadersContext(ctx, c.cfg.Processor.Scope, m, cause) {
		// The server's own headers (Nats-Msg-Id, Nats-Expected-*,
		// Nats-Rollup, Nats-TTL, ...) would change how the dead letter is
		// stored, or get it dropped as a duplicate of the original.
		if len(h.Key) >= 5 && strings.EqualFold(h.Key[:5], "nats-") {
			continue
		}
		v := string(h.Value)
		if strings.HasPrefix(h.Key, "Justonce-") {
			v = headerValue(h.Value)
		}
		out.Header.Add(h.Key, v)
	}
	out.Data = m.Value
	ctx, cancel := context.WithTimeout(ctx, c.cfg.AckTimeout)
	defer cancel()
	if c.js == nil {
		if err := c.cfg.Conn.PublishMsg(out); err != nil {
			return fmt.Errorf("publish dead letter to %s: %w", out.Subject, err)
		}
		if err := c.cfg.Conn.FlushWithContext(ctx); err != nil {
			return fmt.Errorf("publish dead letter to %s: %w", out.Subject, err)
		}
		return nil
	}
	if m.Offset > 0 {
		// The scope too: consumers of one stream with different scopes
		// that dead-letter the same message each keep their dead letter.
		out.Header.Set(jetstream.MsgIDHeader, deadLetterIDPrefix+c.cfg.Stream+":"+strconv.FormatInt(m.Offset, 10)+":"+c.cfg.Processor.Scope)
	}
	if _, err := c.js.PublishMsg(ctx, out); err != nil {
		return fmt.Errorf("publish dead letter to %s (does a stream capture it?): %w", out.Subject, err)
	}
	return nil
}

// headerValue makes v safe as a NATS header value: one line, capped.
func headerValue(v []byte) string {
	s := strings.Map(func(r rune) rune {
		if r == '\r' || r == '\n' {
			return ' '
		}
		return r
	}, string(v))
	if len(s) > maxDLHeaderValue {
		s = s[:maxDLHeaderValue] + "...(truncated)"
	}
	return s
}
