package inbox

import (
	"context"
	"time"
)

// JanitorConfig configures RunJanitor.
type JanitorConfig struct {
	// Interval between sweeps. Default 1 minute.
	Interval time.Duration
	// BatchSize is the most rows one statement deletes. Default 1000: small
	// batches keep locks and WAL bursts short.
	BatchSize int
	// Pause between batches of one sweep. Default 10 ms.
	Pause time.Duration
}

// PurgeExpired deletes up to limit expired rows (oldest first) in one short
// statement, skipping rows another transaction holds and rows whose lease
// still runs. Only one instance purges at a time: when another holds the
// janitor lock it deletes nothing and reports locked false.
func (l *Ledger) PurgeExpired(ctx context.Context, limit int) (deleted int64, locked bool, err error) {
	if limit <= 0 {
		limit = 1000
	}
	n, locked, err := l.store.purge(ctx, l.pool, limit)
	return n, locked, storeErr("purge", err)
}

// RunJanitor sweeps expired rows every Interval until ctx is done; each
// sweep deletes batch after batch until a batch comes back short. Errors
// are logged and retried at the next sweep. It returns ctx's error.
func (l *Ledger) RunJanitor(ctx context.Context, cfg JanitorConfig) error {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Minute
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 1000
	}
	if cfg.Pause <= 0 {
		cfg.Pause = 10 * time.Millisecond
	}
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	for {
		l.Sweep(ctx, cfg)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Sweep deletes expired rows batch by batch until none are left (or another
// instance holds the janitor lock) and returns how many it deleted.
func (l *Ledger) Sweep(ctx context.Context, cfg JanitorConfig) int64 {
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 1000
	}
	var total int64
	for ctx.Err() == nil {
		n, locked, err := l.PurgeExpired(ctx, cfg.BatchSize)
		total += n
		if err != nil {
			l.cfg.Logger.Warn("justonce janitor: purge failed", "err", err)
			return total
		}
		if !locked || n < int64(cfg.BatchSize) {
			return total
		}
		if cfg.Pause > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(cfg.Pause):
			}
		}
	}
	return total
}
