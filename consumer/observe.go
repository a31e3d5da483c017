package consumer

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// Observe mode (Config.Observe): the consumer runs every message, as the
// at-least-once consumer it replaces would, and records in the ledger what
// dedupe would have done, under its own scope. It is the consumers' side
// of the request fronts' observe mode (httpbridge.RouteConfig.Observe,
// grpcbridge.MethodConfig.Observe): the same scope suffix and the same
// names for what would have happened.

// ObserveSuffix is appended to Config.Scope for the IDs an observe-mode
// consumer records, as the bridges append it to an observe-mode route's
// scope: they never meet the IDs of an enforcing consumer or route.
const ObserveSuffix = bridgereq.ObserveSuffix

// What an observe-mode consumer would have done with a message it ran:
// the values Hooks.OnObserve gets (and the would label of
// justonce_consumer_observed_total in package metrics).
const (
	// WouldRun: a new ID; the handler would have run, as it did, and the
	// ID is recorded with its effects.
	WouldRun = bridgereq.WouldRun
	// WouldSkip: a known ID (done, failed for good, or run by another
	// front in the observe scope); dedupe would have acked the message
	// without running the handler. It ran, in a transaction of its own.
	WouldSkip = "would_skip"
	// WouldConflict: the ID was in flight elsewhere; dedupe would have
	// retried the message later. It ran at once.
	WouldConflict = bridgereq.WouldConflict
	// WouldRefuseMissingKey: no ID (and Config.AllowNoID unset); the
	// message would have been dead-lettered. It ran.
	WouldRefuseMissingKey = bridgereq.WouldRefuseMissingKey
	// WouldRefuseInvalidKey: an ID (or tenant) the ledger refuses; the
	// message would have been dead-lettered. It ran.
	WouldRefuseInvalidKey = bridgereq.WouldRefuseInvalidKey
)

// observeMessages are the log messages of observe mode, by would value.
var observeMessages = map[string]string{
	WouldRun:              "justonce consumer: observe mode: new ID, would run",
	WouldSkip:             "justonce consumer: observe mode: duplicate, would skip (ran anyway)",
	WouldConflict:         "justonce consumer: observe mode: ID in flight elsewhere, would retry later (ran anyway)",
	WouldRefuseMissingKey: "justonce consumer: observe mode: no ID, would dead-letter (ran anyway)",
	WouldRefuseInvalidKey: "justonce consumer: observe mode: invalid ID, would dead-letter (ran anyway)",
}

// scope is the ledger scope of the processor's IDs: Config.Scope, with
// ObserveSuffix in observe mode.
func (p *Processor) scope() string {
	if p.cfg.Observe {
		return p.cfg.Scope + ObserveSuffix
	}
	return p.cfg.Scope
}

// observe is Process in observe mode: a new ID runs through the ledger
// (its row and the handler's effects commit together, as when enforcing);
// a message dedupe would have skipped, held back or dead-lettered runs
// without it, in a plain transaction, and is reported.
func (p *Processor) observe(ctx context.Context, m *Message) Decision {
	if m.ID == "" {
		id, err := p.cfg.ID(m)
		if err != nil || id == "" {
			if err == nil {
				err = ErrNoID
			}
			if !p.cfg.AllowNoID {
				p.observed(ctx, m, WouldRefuseMissingKey, slog.LevelWarn, "err", err)
			}
			return p.runUndeduped(ctx, m)
		}
		m.ID = id
	}
	req := p.request(m)
	if err := p.cfg.Ledger.Validate(req); err != nil {
		p.observed(ctx, m, WouldRefuseInvalidKey, slog.LevelWarn, "err", err)
		return p.runUndeduped(ctx, m)
	}
	start := time.Now()
	var out inbox.Outcome
	var err error
	ran := false
	func() {
		defer recovered(&err)
		out, err = p.cfg.Ledger.Do(ctx, req, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
			ran = true
			return p.call(ctx, tx, m)
		})
	}()
	if err == nil {
		switch out.Disposition {
		case inbox.Duplicate, inbox.Mismatch:
			p.observed(ctx, m, WouldSkip, slog.LevelInfo)
			return p.runUndeduped(ctx, m)
		case inbox.InFlight:
			p.observed(ctx, m, WouldConflict, slog.LevelInfo)
			return p.runUndeduped(ctx, m)
		case inbox.Executed:
			p.observed(ctx, m, WouldRun, slog.LevelDebug)
		}
	}
	return p.decide(ctx, m, out, err, time.Since(start), ran)
}

// observed reports what dedupe would have done with m: the hook, and a log
// line at level.
func (p *Processor) observed(ctx context.Context, m *Message, would string, level slog.Level, kv ...any) {
	if p.cfg.Hooks.OnObserve != nil {
		p.cfg.Hooks.OnObserve(m, would)
	}
	if !p.log.Enabled(ctx, level) {
		return
	}
	attrs := append([]any{"scope", p.cfg.Scope, "would", would, "id", inbox.Mask(m.ID), "topic", m.Topic,
		"attempt", m.Attempt}, kv...)
	p.log.Log(ctx, level, observeMessages[would], attrs...)
}
