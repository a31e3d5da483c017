package inbox

import (
	"context"
	"errors"
	"time"
)

// JanitorConfig configures Purge and RunJanitor.
type JanitorConfig struct {
	// Interval between purges (RunJanitor). Default 1 minute.
	Interval time.Duration
	// BatchSize is the most rows one statement deletes. Default 1000: small
	// batches keep locks and WAL bursts short.
	BatchSize int
	// Pause between batches of one purge. Default 10 ms.
	Pause time.Duration
}

// ErrJanitorBusy: another instance holds the janitor lock of this ledger,
// so this one purged nothing (or stopped after the rows it reports).
var ErrJanitorBusy = errors.New("justonce/inbox: another janitor is purging this ledger")

// Purge deletes expired rows, cfg.BatchSize at a time with cfg.Pause
// between batches, until none are left, and returns how many it deleted.
// Then it deletes the expired recorded steps (DoSteps) in the same way,
// on both layouts, without counting them, and last clears the stored
// results past their own clock (Request.ResultTTL; rows whose key lives
// on): one UPDATE per batch on both layouts, not counted either.
// Each batch is one short statement that skips rows another transaction
// holds and rows whose lease still runs. Only one instance purges a ledger
// at a time: when another holds the janitor lock Purge returns
// ErrJanitorBusy.
//
// On the time-bucket layout (migrations.LayoutTimeBuckets) Purge deletes no
// rows: it opens each shard's next bucket when it is due, and detaches and
// drops each bucket closed at least MaxTTL ago (all its rows have expired)
// that holds no running lease; it returns the rows those buckets held, as
// Postgres estimates them. The detach waits for transactions still using
// the table, without blocking claims. While no janitor runs, claims go on
// in the newest buckets, which grow.
func (l *Ledger) Purge(ctx context.Context, cfg JanitorConfig) (deleted int64, err error) {
	cfg.setDefaults()
	s, err := l.store.get(ctx, l.pool)
	if err != nil {
		return 0, storeErr("purge", err)
	}
	for {
		n, more, locked, err := s.purge(ctx, l.pool, cfg.BatchSize)
		deleted += n
		if err != nil {
			return deleted, storeErr("purge", err)
		}
		if !locked {
			return deleted, ErrJanitorBusy
		}
		if !more {
			break
		}
		if err := pause(ctx, cfg.Pause); err != nil {
			return deleted, err
		}
	}
	// The expired steps (DoSteps), in batches under the same lock; they
	// are not counted.
	for {
		_, more, locked, err := l.store.rows.purgeSteps(ctx, l.pool, cfg.BatchSize)
		if err != nil {
			return deleted, storeErr("purge steps", err)
		}
		if !locked {
			return deleted, ErrJanitorBusy
		}
		if !more {
			break
		}
		if err := pause(ctx, cfg.Pause); err != nil {
			return deleted, err
		}
	}
	return deleted, l.clearResults(ctx, cfg)
}

// clearSlack is how far before the previous pass's time a pass looks for
// results to clear: a result's clock starts when its row is written, at
// most a commit's time before the row is seen.
const clearSlack = time.Minute

// clearResults clears the stored results past their own clock
// (Request.ResultTTL), in batches under the janitor lock. Each pass looks
// from a little before the last complete pass of this ledger on (all of
// them, the first time), so that the BRIN index skips the ranges cleared
// already; reads never answer a result past its clock, cleared or not.
func (l *Ledger) clearResults(ctx context.Context, cfg JanitorConfig) error {
	since := time.Time{}
	if us := l.resultsCleared.Load(); us != 0 {
		since = time.UnixMicro(us).Add(-clearSlack)
	}
	for {
		_, more, locked, at, err := l.store.rows.clearResults(ctx, l.pool, cfg.BatchSize, since)
		if err != nil {
			return storeErr("clear results", err)
		}
		if !locked {
			return ErrJanitorBusy
		}
		if !more {
			l.resultsCleared.Store(at.UnixMicro())
			return nil
		}
		if err := pause(ctx, cfg.Pause); err != nil {
			return err
		}
	}
}

// pause waits d, or until ctx ends (its error).
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (c *JanitorConfig) setDefaults() {
	if c.Interval <= 0 {
		c.Interval = time.Minute
	}
	if c.BatchSize <= 0 {
		c.BatchSize = 1000
	}
	if c.Pause <= 0 {
		c.Pause = 10 * time.Millisecond
	}
}

// RunJanitor runs Purge every Interval until ctx is done. Failures are
// logged and retried at the next interval; another instance purging is
// not a failure. It returns ctx's error.
func (l *Ledger) RunJanitor(ctx context.Context, cfg JanitorConfig) error {
	cfg.setDefaults()
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	for {
		if _, err := l.Purge(ctx, cfg); err != nil && !errors.Is(err, ErrJanitorBusy) && ctx.Err() == nil {
			l.cfg.Logger.WarnContext(ctx, "justonce janitor: purge failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
