package inbox

import (
	"context"
	"errors"
	"fmt"
)

// Errors of the Redis replay cache, for Release and RecordFailure on a
// ledger with Redis configured. The error is a *CacheError.
var (
	// ErrCacheUnavailable: Redis did not answer before the row was
	// touched, so nothing was changed (the row was not released). Retry
	// when Redis is back.
	ErrCacheUnavailable = errors.New("justonce/inbox: Redis replay cache unavailable; nothing was changed")

	// ErrCacheStale: the Postgres step was done (the row released, or
	// recorded failed; for Release also when there was no row to delete),
	// but the key's cached result could not be deleted from Redis. Until that entry's TTL ends (at most the row's retention),
	// a duplicate may still be answered from it. Delete the key's entry
	// in Redis, or call Release again once Redis answers.
	ErrCacheStale = errors.New("justonce/inbox: Redis replay cache may be stale")
)

// CacheError is ErrCacheUnavailable (Stale false) or ErrCacheStale (Stale
// true), with the operation and key it concerns.
type CacheError struct {
	// Op is "release" or "record failure".
	Op string
	// Key is the key concerned.
	Key Key
	// Stale reports that the Postgres step ran (Release's bool says
	// whether a row was deleted) but the cache could not be invalidated:
	// it may still hold the old result.
	Stale bool
	// Err is Redis's error.
	Err error
}

func (e *CacheError) Error() string {
	if e.Stale {
		return fmt.Sprintf("justonce/inbox: %s %s: Postgres is up to date, but the Redis replay cache could not be invalidated (%v); "+
			"a stale cached answer may be served until the cache entry's TTL ends", e.Op, e.Key, e.Err)
	}
	return fmt.Sprintf("justonce/inbox: %s %s: Redis replay cache unavailable (%v); nothing was changed", e.Op, e.Key, e.Err)
}

// Unwrap returns Redis's error.
func (e *CacheError) Unwrap() error { return e.Err }

// Is reports whether target is ErrCacheStale (Stale) or
// ErrCacheUnavailable (not Stale).
func (e *CacheError) Is(target error) bool {
	if e.Stale {
		return target == ErrCacheStale
	}
	return target == ErrCacheUnavailable
}

// Release deletes k's row whatever its state, so the key is new again: the
// operator's tool for a stuck key, or a failed one whose cause was fixed.
// It reports whether a row was there. The key's recorded steps (DoSteps)
// are deleted with the row, in the same transaction: the next attempt runs
// every step again.
//
// With Redis configured, Release also deletes the key's cached result and
// Redis lock, after the row. When it returns a nil error, no call that
// starts afterwards is answered from the old result: not from the cache,
// and not from a cache write of a call that read the old row while Release
// ran (see RedisConfig). Calls running concurrently with Release may still
// answer the old result. When Redis does not answer before the row is
// touched, Release changes nothing and returns false with
// ErrCacheUnavailable. When the row was deleted but the cache could not be
// invalidated after a few tries, it returns true (the row is gone) with
// ErrCacheStale: a stale cached answer may be served until the entry's TTL
// ends. A nil error is never returned in that case.
//
// Once the row is deleted, the caller's cancellation no longer stops the
// invalidation; it is bounded by a few Redis timeouts. When Postgres
// fails (the row may or may not have been deleted, if the answer was
// lost), the cached result is deleted all the same; call Release again.
func (l *Ledger) Release(ctx context.Context, k Key) (bool, error) {
	return l.release(ctx, k, false)
}

// ReleaseStuck is Release for a key that cannot be in use: it deletes k's
// row only when the key failed, or is processing under a lease that ran
// out (its holder crashed or hung), or the row expired. A key that is done,
// or whose lease still runs (its handler may be running, even past the
// row's expiry), is left as it is: ReleaseStuck then returns false with an
// error matching ErrNotStuck.
// The check and the delete are one statement, so a key that completes
// while ReleaseStuck runs is never released. A key's recorded steps
// (DoSteps) go with its row, as with Release; a key left with steps and no
// row has them deleted. It reports whether a row was
// deleted; false with a nil error means there was no live row. Redis is
// handled as by Release.
func (l *Ledger) ReleaseStuck(ctx context.Context, k Key) (bool, error) {
	return l.release(ctx, k, true)
}

func (l *Ledger) release(ctx context.Context, k Key, stuckOnly bool) (bool, error) {
	if err := k.Validate(l.cfg.MaxKeyLen); err != nil {
		return false, err
	}
	if l.fast != nil {
		if err := l.fast.ping(ctx, k); err != nil {
			if ctx.Err() != nil {
				return false, fmt.Errorf("justonce/inbox: release: %w", ctx.Err())
			}
			return false, &CacheError{Op: "release", Key: k, Err: err}
		}
	}
	var ok, live bool
	var err error
	if stuckOnly {
		ok, live, err = l.store.rows.releaseStuck(ctx, l.pool, k)
	} else {
		ok, err = l.store.rows.release(ctx, l.pool, k)
	}
	if err != nil {
		if l.fast != nil {
			// The delete may have committed before its answer was lost:
			// drop the cached result anyway (always safe: Postgres answers
			// instead), so that a released row is not answered from it.
			_ = l.invalidate(ctx, "release", k)
		}
		return false, storeErr("release", err)
	}
	if live {
		return false, fmt.Errorf("%w: %s is done, or its lease still runs", ErrNotStuck, k)
	}
	if l.fast != nil {
		if err := l.invalidate(ctx, "release", k); err != nil {
			return ok, err
		}
	}
	return ok, nil
}

// invalidate drops k's cached result and lock after the row changed.
func (l *Ledger) invalidate(ctx context.Context, op string, k Key) error {
	if l.fast.afterChange != nil {
		l.fast.afterChange(k)
	}
	if err := l.fast.invalidate(ctx, k); err != nil {
		return &CacheError{Op: op, Key: k, Stale: true, Err: err}
	}
	return nil
}

// RecordFailure marks req's key failed (a consumer gave up on it and
// dead-lettered it), with the error text and the number of attempts. A key
// already done is left as it is, and RecordFailure reports false. Later
// deliveries of a failed key answer Duplicate with the Record's Status
// failed, until it is released or expires.
//
// With Redis configured, the key's cached result and lock are deleted after
// the row is written, as Release does. Unlike Release, RecordFailure does
// not wait for Redis before writing the row (a consumer dead-letters during
// a Redis outage too); when the cache could not be invalidated it reports
// the write (true when the row was recorded) with ErrCacheStale.
func (l *Ledger) RecordFailure(ctx context.Context, req Request, attempts int, cause error) (bool, error) {
	if err := l.Validate(req); err != nil {
		return false, err
	}
	msg := ""
	if cause != nil {
		msg = cause.Error()
	}
	s, err := l.store.get(ctx, l.pool)
	var ok bool
	if err == nil {
		ok, err = s.recordFailure(ctx, l.pool, failParams{req: req, attempts: attempts, errText: msg, ttl: l.ttl(req)})
	}
	if err != nil {
		return false, storeErr("record failure", err)
	}
	if l.fast != nil && ok {
		if err := l.invalidate(ctx, "record failure", req.Key); err != nil {
			return ok, err
		}
	}
	return ok, nil
}
