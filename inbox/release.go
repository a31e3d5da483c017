package inbox

import (
	"context"
)

// Release deletes k's row whatever its state, so the key is new again: the
// operator's tool for a stuck key. It also drops the key from the Redis
// replay cache. It reports whether a row was there. When the cache could not
// be invalidated the row is still released and the error says so.
func (l *Ledger) Release(ctx context.Context, k Key) (bool, error) {
	if err := k.Validate(l.cfg.MaxKeyLen); err != nil {
		return false, err
	}
	ok, err := l.store.release(ctx, l.pool, k)
	if err != nil {
		return false, storeErr("release", err)
	}
	if l.fast != nil {
		if err := l.fast.invalidate(ctx, k); err != nil {
			return ok, err
		}
	}
	return ok, nil
}

// RecordFailure marks req's key failed (a consumer gave up on it and
// dead-lettered it), with the error text and the number of attempts. A key
// already done is left as it is, and RecordFailure reports false. Later
// deliveries of a failed key answer Duplicate with the Record's Status
// failed, until it is released or expires.
func (l *Ledger) RecordFailure(ctx context.Context, req Request, attempts int, cause error) (bool, error) {
	if err := l.Validate(req); err != nil {
		return false, err
	}
	msg := ""
	if cause != nil {
		msg = cause.Error()
	}
	ok, err := l.store.fail(ctx, l.pool, req, attempts, msg, l.ttl(req))
	if err != nil {
		return false, storeErr("record failure", err)
	}
	if l.fast != nil {
		_ = l.fast.invalidate(ctx, req.Key)
	}
	return ok, nil
}
